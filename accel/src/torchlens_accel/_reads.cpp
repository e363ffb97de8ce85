/* Reads of torch's state that its Python bindings make slowly, for the hot path and the end of a trace.
 *
 * stale(saved, saved_versions)
 *     The end-of-trace check of saved activations (CaptureState.check_saved_versions).  A trace keeps,
 *     beside each saved tensor, its version when it was saved; at the end it drops what a write capture
 *     could not see has changed since (a write with torch functions disabled, say), and what a torch.func
 *     transform made (its internal wrapper).  From Python both reads go through bindings that cost more
 *     than the rest of a small op's record (``t._version`` and the pybind call
 *     ``is_functorch_wrapped_tensor``: about 0.25 us per saved tensor); here both are read off the
 *     TensorImpl.  Returns the indices, in ``saved_versions`` order, whose tensor's version is no longer
 *     the one saved; or None where it cannot answer exactly as the Python loop does, which then runs
 *     instead: a value that is not a plain ``torch.Tensor`` or ``Parameter`` (a subclass may answer
 *     ``_version`` itself), a tensor carrying a functorch or functionalization key (the Python predicate
 *     decides those), an inference tensor with a version to compare, a version that is not an int, an
 *     index missing from ``saved``, or containers other than plain dicts.
 *
 * any_autocast()
 *     ``torch._C._is_any_autocast_enabled()``, which the handler asks once per op (whether the op ran
 *     under autocast: its context is then recorded); torch's binding builds a vector of device types per
 *     call.  The same device types, asked of the same thread-local state in one read.
 *
 * Built against torch's headers like ``_autograd``, and used only with the torch it was built for.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <ATen/autocast_mode.h>
#include <c10/core/DispatchKeySet.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/csrc/autograd/python_variable.h>

/* Bumped with torchlens.capture.accel.ABI whenever what is built here changes meaning. */
#define TORCHLENS_ACCEL_ABI 1

#ifndef TORCHLENS_TORCH_VERSION
#error "build with -DTORCHLENS_TORCH_VERSION=\"<torch.__version__>\" (accel/setup.py does)"
#endif

namespace {

/* The keys ``is_functorch_wrapped_tensor`` looks for (a batched tensor, a grad wrapper, a functional
 * tensor): a tensor with none of them is not wrapped. */
const c10::DispatchKeySet kWrapperKeys({c10::DispatchKey::FuncTorchBatched, c10::DispatchKey::BatchedNestedTensor,
                                        c10::DispatchKey::FuncTorchGradWrapper, c10::DispatchKey::Functionalize});

/* 1 when every saved value is a plain tensor no transform wrapped, 0 when the Python loop must decide. */
int all_plain(PyObject *saved) {
    Py_ssize_t pos = 0;
    PyObject *key, *value;
    while (PyDict_Next(saved, &pos, &key, &value)) {
        if (!THPVariable_CheckExact(value)) return 0;
        const at::Tensor &t = THPVariable_Unpack(value);
        if (t.unsafeGetTensorImpl()->key_set().has_any(kWrapperKeys)) return 0;
    }
    return 1;
}

PyObject *stale(PyObject *, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "stale(saved, saved_versions) takes two arguments");
        return nullptr;
    }
    PyObject *saved = args[0], *versions = args[1];
    if (!PyDict_CheckExact(saved) || !PyDict_CheckExact(versions) || !all_plain(saved)) Py_RETURN_NONE;
    PyObject *changed = PyList_New(0);
    if (changed == nullptr) return nullptr;
    Py_ssize_t pos = 0;
    PyObject *index, *version;
    while (PyDict_Next(versions, &pos, &index, &version)) {
        if (version == Py_None) continue;
        PyObject *value = PyDict_GetItemWithError(saved, index);
        if (value == nullptr || !PyLong_CheckExact(version)) {
            Py_DECREF(changed);
            if (PyErr_Occurred()) return nullptr;
            Py_RETURN_NONE;
        }
        const at::Tensor &t = THPVariable_Unpack(value);
        long long expected = PyLong_AsLongLong(version);
        if (expected == -1 && PyErr_Occurred()) {
            Py_DECREF(changed);
            return nullptr;
        }
        if (t.is_inference()) {  /* ``_version`` raises for it: the Python loop says so */
            Py_DECREF(changed);
            Py_RETURN_NONE;
        }
        if (static_cast<long long>(t._version()) != expected && PyList_Append(changed, index) < 0) {
            Py_DECREF(changed);
            return nullptr;
        }
    }
    return changed;
}

/* The device types torch's ``_is_any_autocast_enabled`` asks about (tests/test_reads_accel.py checks
 * each device type torch accepts against it). */
const c10::DeviceType kAutocastDevices[] = {at::kCPU, at::kCUDA, at::kXPU, at::kIPU, at::kHPU, at::kXLA,
                                            at::kPrivateUse1, at::kMTIA};

/* Their autocast dispatch keys: autocast is on for a device type while its key is not excluded on this
 * thread (what ``at::autocast::is_autocast_enabled`` asks, one thread-local read per device type). */
c10::DispatchKeySet autocast_keys() {
    c10::DispatchKeySet keys;
    for (c10::DeviceType device : kAutocastDevices)
        keys = keys | c10::DispatchKeySet(at::autocast::get_autocast_dispatch_key_from_device_type(device));
    return keys;
}

const c10::DispatchKeySet kAutocastKeys = autocast_keys();

/* Whether any of those keys is not excluded: one read of the thread's dispatch key set. */
PyObject *any_autocast(PyObject *, PyObject *) {
    c10::DispatchKeySet excluded = c10::impl::tls_local_dispatch_key_set().excluded_;
    if ((excluded & kAutocastKeys) != kAutocastKeys) Py_RETURN_TRUE;
    Py_RETURN_FALSE;
}

PyMethodDef reads_methods[] = {
    {"stale", (PyCFunction)(void (*)(void))stale, METH_FASTCALL,
     "stale(saved, saved_versions): the indices whose saved tensor changed version since it was saved, in "
     "saved_versions order; None where the Python check must decide."},
    {"any_autocast", (PyCFunction)any_autocast, METH_NOARGS,
     "torch._C._is_any_autocast_enabled(), read without building a list of device types."},
    {nullptr},
};

PyModuleDef reads_module = {PyModuleDef_HEAD_INIT, "_reads",
                            "Reads of torch's state that its Python bindings make slowly.", -1, reads_methods};

}  // namespace

PyMODINIT_FUNC PyInit__reads(void) {
    PyObject *m = PyModule_Create(&reads_module);
    if (m == nullptr) return nullptr;
    if (PyModule_AddIntConstant(m, "ABI", TORCHLENS_ACCEL_ABI) < 0 ||
        PyModule_AddStringConstant(m, "TORCH_VERSION", TORCHLENS_TORCH_VERSION) < 0) {
        Py_DECREF(m);
        return nullptr;
    }
    return m;
}
