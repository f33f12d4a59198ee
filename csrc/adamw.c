/* adamw.c: OffloadStreamAdamW: CPU AdamW kernels and the bucket pipeline's C side.
 * (Placeholder table: filled in by the component's implementation.) */
#include "mp_python.h"

PyMethodDef mp_adamw_methods[] = {
    {NULL, NULL, 0, NULL},
};
