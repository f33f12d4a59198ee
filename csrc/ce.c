/* ce.c: Ring-DTP: online log-sum-exp fold and softmax-gradient epilogue (CPU kernels + CUDA launchers).
 * (Placeholder table: filled in by the component's implementation.) */
#include "mp_python.h"

PyMethodDef mp_ce_methods[] = {
    {NULL, NULL, 0, NULL},
};
