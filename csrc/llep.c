/* llep.c: PipelinedLLEP: the LLEP planner, chunk slicing, row permutation and combine.
 * (Placeholder table: filled in by the component's implementation.) */
#include "mp_python.h"

PyMethodDef mp_llep_methods[] = {
    {NULL, NULL, 0, NULL},
};
