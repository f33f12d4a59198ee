/* nccl.c: NCCL transport: dlopen'ed libnccl, communicator from a unique id, send/recv, all-to-all-v.
 * (Placeholder table: filled in by the component's implementation.) */
#include "mp_python.h"

PyMethodDef mp_transport_methods[] = {
    {NULL, NULL, 0, NULL},
};
