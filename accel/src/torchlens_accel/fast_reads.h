/* What ``_reads`` (C++, built against torch) offers ``_capture`` (plain C) through a capsule: a tensor's
 * record fields and version read off its TensorImpl, where torch's attribute getters each set up a warning
 * handler and an error guard.  ``_capture`` asks these only for exact ``torch.Tensor`` and ``Parameter``
 * objects, and falls back to the getters whenever they cannot answer, so the record is the same. */
#ifndef TORCHLENS_FAST_READS_H
#define TORCHLENS_FAST_READS_H

#include <Python.h>

#define TORCHLENS_FAST_READS_NAME "torchlens_accel._reads.fast_reads"
#define TORCHLENS_FAST_READS_ABI 2

typedef struct {
    int abi;
    /* ``t.shape``, ``t.dtype``, ``t.device`` (new references), ``t.requires_grad``, and ``t.grad_fn`` (a new
     * reference, None for a leaf) when it requires grad (else NULL): 0; 1 where it cannot answer as the
     * getters would (a nested tensor, symbolic sizes), nothing set; -1 with an exception. */
    int (*facts)(PyObject *t, PyObject **shape, PyObject **dtype, PyObject **device, int *requires_grad,
                 PyObject **grad_fn);
    /* ``t._version`` as a new int; NULL with no exception where it cannot answer (an inference tensor),
     * NULL with one on error. */
    PyObject *(*version)(PyObject *t);
    /* 1 when grad mode is on (``torch.is_grad_enabled()``), | 2 when autocast is on for any device type
     * (``torch._C._is_any_autocast_enabled()``), read from this thread's state. */
    int (*context)(void);
} FastReads;

#endif
