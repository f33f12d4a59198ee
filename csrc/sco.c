/* sco.c: SCO: pinned arena and copy engine for checkpoint boundaries.
 * (Placeholder table: filled in by the component's implementation.) */
#include "mp_python.h"

PyMethodDef mp_sco_methods[] = {
    {NULL, NULL, 0, NULL},
};
