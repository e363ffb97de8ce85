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
 * versions(tensors)
 *     Each tensor's version, as ``record.layouts.param_versions`` reads them from Python: the parameters'
 *     versions as every trace begins and ends (replay checks that none moved since).  From Python each is an
 *     attribute read through a binding that sets up a warning handler (about 500 instructions a
 *     parameter); here a list of ints read off the TensorImpls.  None where that pass must decide: a
 *     container other than a list, a value that is not a plain ``torch.Tensor`` or ``Parameter`` (a
 *     subclass may answer ``_version`` itself), an inference tensor (it has no version).
 *
 * requires_grad(tensors)
 *     Each tensor's requires_grad flag, as ``record.layouts.requires_grad_flags`` reads them from Python (the
 *     parameters' flags as a trace ends, for replay), off the TensorImpls; None where that pass must decide:
 *     a container other than a list, a value that is not a plain ``torch.Tensor`` or ``Parameter``.
 *
 * same_layouts(tensors, layouts)
 *     Whether each tensor's shape and dtype are still the ``(torch.Size, dtype)`` pair at its position in
 *     ``layouts``, as ``record.layouts.param_layouts`` compares them from Python (the parameters' as a trace
 *     ends: data replaced by ``p.data = ...`` or ``model.half()`` moves no version counter).  From Python two
 *     getters a parameter; here read off the TensorImpls.  None where that pass must decide: a container
 *     other than a list, a value that is not a plain ``torch.Tensor`` or ``Parameter``, a nested tensor or
 *     one of symbolic sizes, an entry of ``layouts`` that is not a pair of a tuple of ints and a dtype.
 *
 * any_autocast()
 *     ``torch._C._is_any_autocast_enabled()``, which the handler asks once per op (whether the op ran
 *     under autocast: its context is then recorded); torch's binding builds a vector of device types per
 *     call.  The same device types, asked of the same thread-local state in one read.
 *
 * fast_reads
 *     A capsule for ``_capture``'s handler (fast_reads.h): an output's shape, dtype, device,
 *     requires_grad and grad_fn, and a tensor's version, read off the TensorImpl; grad mode and autocast, read off
 *     the thread's state, without a Python call.  Torch's attribute getters each set up a warning
 *     handler and an error guard; a small op's record reads five of them.
 *
 * Built against torch's headers like ``_autograd``, and used only with the torch it was built for.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <ATen/autocast_mode.h>
#include <c10/core/GradMode.h>
#include <c10/core/DispatchKeySet.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/csrc/Device.h>
#include <torch/csrc/DynamicTypes.h>
#include <torch/csrc/autograd/python_cpp_function.h>
#include <torch/csrc/autograd/python_variable.h>

extern "C" {
#include "fast_reads.h"
}

/* Bumped with torchlens.capture.accel.ABI whenever what is built here changes meaning. */
#define TORCHLENS_ACCEL_ABI 5

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

/* A tensor's version into ``*out``; false for an inference tensor (it has none: ``_version`` raises) or when
 * torch throws, where the Python reads decide. */
bool read_version(PyObject *obj, long long *out) {
    try {
        const at::Tensor &t = THPVariable_Unpack(obj);
        if (t.is_inference()) return false;
        *out = static_cast<long long>(t._version());
        return true;
    } catch (...) {
        return false;
    }
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
        long long expected = PyLong_AsLongLong(version);
        if (expected == -1 && PyErr_Occurred()) {
            Py_DECREF(changed);
            return nullptr;
        }
        long long now = 0;
        if (!read_version(value, &now)) {  /* the Python loop says why */
            Py_DECREF(changed);
            Py_RETURN_NONE;
        }
        if (now != expected && PyList_Append(changed, index) < 0) {
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
    for (c10::DeviceType device : kAutocastDevices) {
        try {
            keys = keys | c10::DispatchKeySet(at::autocast::get_autocast_dispatch_key_from_device_type(device));
        } catch (...) {  /* a device type this torch has no autocast for: never on */
        }
    }
    return keys;
}

const c10::DispatchKeySet kAutocastKeys = autocast_keys();

/* Whether any of those keys is not excluded: one read of the thread's dispatch key set. */
bool autocast_on() {
    c10::DispatchKeySet excluded = c10::impl::tls_local_dispatch_key_set().excluded_;
    return (excluded & kAutocastKeys) != kAutocastKeys;
}

PyObject *any_autocast(PyObject *, PyObject *) {
    return Py_NewRef(autocast_on() ? Py_True : Py_False);
}

PyTypeObject *size_type = nullptr;  /* torch.Size, set when the module is imported */

/* ``t.shape`` as the getter builds it for concrete sizes: a torch.Size of ints. */
PyObject *size_of(c10::IntArrayRef sizes) {
    PyObject *size = size_type->tp_alloc(size_type, static_cast<Py_ssize_t>(sizes.size()));
    if (size == nullptr) return nullptr;
    for (size_t i = 0; i < sizes.size(); i++) {
        PyObject *n = PyLong_FromLongLong(sizes[i]);
        if (n == nullptr) {
            Py_DECREF(size);
            return nullptr;
        }
        PyTuple_SET_ITEM(size, static_cast<Py_ssize_t>(i), n);
    }
    return size;
}

int facts(PyObject *obj, PyObject **shape, PyObject **dtype, PyObject **device, int *requires_grad,
          PyObject **grad_fn) {
    at::Device where(at::kCPU);
    at::ScalarType scalar;
    c10::IntArrayRef sizes;
    c10::intrusive_ptr<torch::autograd::Node> node;
    bool rg;
    try {
        const at::Tensor &t = THPVariable_Unpack(obj);
        const c10::TensorImpl *impl = t.unsafeGetTensorImpl();
        if (impl->is_nested() || impl->has_symbolic_sizes_strides()) return 1;
        sizes = t.sizes();
        scalar = t.scalar_type();
        where = t.device();
        rg = t.requires_grad();
        if (rg) node = t.grad_fn();
    } catch (...) {
        return 1;  /* the getters raise what torch raises */
    }
    PyObject *size = size_of(sizes);
    if (size == nullptr) return -1;
    PyObject *place = nullptr, *fn = nullptr;
    try {
        place = THPDevice_New(where);
        if (place != nullptr && rg) fn = node ? torch::autograd::functionToPyObject(node) : Py_NewRef(Py_None);
    } catch (...) {
        Py_CLEAR(place);
        fn = nullptr;
    }
    if (place == nullptr || (rg && fn == nullptr)) {
        Py_DECREF(size);
        Py_XDECREF(place);
        if (PyErr_Occurred()) return -1;
        return 1;
    }
    *shape = size;
    *dtype = Py_NewRef(reinterpret_cast<PyObject *>(torch::getTHPDtype(scalar)));
    *device = place;
    *requires_grad = rg;
    *grad_fn = fn;
    return 0;
}

PyObject *version(PyObject *obj) {
    long long v;
    return read_version(obj, &v) ? PyLong_FromLongLong(v) : nullptr;
}

PyObject *versions(PyObject *, PyObject *tensors) {
    if (!PyList_CheckExact(tensors)) Py_RETURN_NONE;
    Py_ssize_t n = PyList_GET_SIZE(tensors);
    PyObject *out = PyList_New(n);
    if (out == nullptr) return nullptr;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *value = PyList_GET_ITEM(tensors, i);
        long long v;
        if (!THPVariable_CheckExact(value) || !read_version(value, &v)) {  /* the Python pass decides */
            Py_DECREF(out);
            Py_RETURN_NONE;
        }
        PyObject *number = PyLong_FromLongLong(v);
        if (number == nullptr) {
            Py_DECREF(out);
            return nullptr;
        }
        PyList_SET_ITEM(out, i, number);
    }
    return out;
}

PyObject *requires_grad(PyObject *, PyObject *tensors) {
    if (!PyList_CheckExact(tensors)) Py_RETURN_NONE;
    Py_ssize_t n = PyList_GET_SIZE(tensors);
    for (Py_ssize_t i = 0; i < n; i++)
        if (!THPVariable_CheckExact(PyList_GET_ITEM(tensors, i))) Py_RETURN_NONE;  /* the Python pass decides */
    PyObject *out = PyList_New(n);
    if (out == nullptr) return nullptr;
    for (Py_ssize_t i = 0; i < n; i++) {
        bool flag = THPVariable_Unpack(PyList_GET_ITEM(tensors, i)).requires_grad();
        PyList_SET_ITEM(out, i, Py_NewRef(flag ? Py_True : Py_False));
    }
    return out;
}

/* 1 when ``shape`` (a tuple of ints) is ``sizes``, 0 when not, -1 when the Python pass must decide. */
int same_sizes(PyObject *shape, c10::IntArrayRef sizes) {
    if (!PyTuple_Check(shape)) return -1;
    if (PyTuple_GET_SIZE(shape) != static_cast<Py_ssize_t>(sizes.size())) return 0;
    for (size_t i = 0; i < sizes.size(); i++) {
        PyObject *n = PyTuple_GET_ITEM(shape, static_cast<Py_ssize_t>(i));
        if (!PyLong_CheckExact(n)) return -1;
        long long value = PyLong_AsLongLong(n);
        if (value == -1 && PyErr_Occurred()) {
            PyErr_Clear();
            return -1;
        }
        if (value != sizes[i]) return 0;
    }
    return 1;
}

/* 1 when ``obj``'s shape and dtype are ``layout``'s, 0 when not, -1 when the Python pass must decide. */
int same_layout(PyObject *obj, PyObject *layout) {
    if (!THPVariable_CheckExact(obj) || !PyTuple_CheckExact(layout) || PyTuple_GET_SIZE(layout) != 2) return -1;
    PyObject *dtype = PyTuple_GET_ITEM(layout, 1);
    if (!THPDtype_Check(dtype)) return -1;
    try {
        const at::Tensor &t = THPVariable_Unpack(obj);
        const c10::TensorImpl *impl = t.unsafeGetTensorImpl();
        if (impl->is_nested() || impl->has_symbolic_sizes_strides()) return -1;
        if (reinterpret_cast<THPDtype *>(dtype)->scalar_type != t.scalar_type()) return 0;
        return same_sizes(PyTuple_GET_ITEM(layout, 0), t.sizes());
    } catch (...) {
        return -1;
    }
}

PyObject *same_layouts(PyObject *, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "same_layouts(tensors, layouts) takes two arguments");
        return nullptr;
    }
    PyObject *tensors = args[0], *layouts = args[1];
    if (!PyList_CheckExact(tensors) || !PyList_CheckExact(layouts)) Py_RETURN_NONE;
    Py_ssize_t n = PyList_GET_SIZE(tensors);
    if (PyList_GET_SIZE(layouts) != n) Py_RETURN_FALSE;
    for (Py_ssize_t i = 0; i < n; i++) {
        int answer = same_layout(PyList_GET_ITEM(tensors, i), PyList_GET_ITEM(layouts, i));
        if (answer < 0) Py_RETURN_NONE;
        if (answer == 0) Py_RETURN_FALSE;
    }
    Py_RETURN_TRUE;
}

int context() {
    return (c10::GradMode::is_enabled() ? 1 : 0) | (autocast_on() ? 2 : 0);
}

FastReads fast_reads = {TORCHLENS_FAST_READS_ABI, facts, version, context};

PyMethodDef reads_methods[] = {
    {"stale", (PyCFunction)(void (*)(void))stale, METH_FASTCALL,
     "stale(saved, saved_versions): the indices whose saved tensor changed version since it was saved, in "
     "saved_versions order; None where the Python check must decide."},
    {"versions", (PyCFunction)versions, METH_O,
     "versions(tensors): each tensor's version, read off its TensorImpl, as a list of ints; None where the "
     "Python pass must decide."},
    {"requires_grad", (PyCFunction)requires_grad, METH_O,
     "requires_grad(tensors): each tensor's requires_grad flag, read off its TensorImpl, as a list of bools; "
     "None where the Python pass must decide."},
    {"same_layouts", (PyCFunction)(void (*)(void))same_layouts, METH_FASTCALL,
     "same_layouts(tensors, layouts): whether each tensor's shape and dtype are the (torch.Size, dtype) pair "
     "at its position in layouts; None where the Python pass must decide."},
    {"any_autocast", (PyCFunction)any_autocast, METH_NOARGS,
     "torch._C._is_any_autocast_enabled(), read without building a list of device types."},
    {nullptr},
};

PyModuleDef reads_module = {PyModuleDef_HEAD_INIT, "_reads",
                            "Reads of torch's state that its Python bindings make slowly.", -1, reads_methods};

}  // namespace

PyMODINIT_FUNC PyInit__reads(void) {
    PyObject *torch = PyImport_ImportModule("torch");
    PyObject *size = torch != nullptr ? PyObject_GetAttrString(torch, "Size") : nullptr;
    Py_XDECREF(torch);
    if (size == nullptr) return nullptr;
    if (!PyType_Check(size) || !PyType_IsSubtype(reinterpret_cast<PyTypeObject *>(size), &PyTuple_Type)) {
        Py_DECREF(size);
        PyErr_SetString(PyExc_ImportError, "torchlens_accel._reads: torch.Size is not a tuple type");
        return nullptr;
    }
    size_type = reinterpret_cast<PyTypeObject *>(size);  /* kept for the life of the process */
    PyObject *m = PyModule_Create(&reads_module);
    if (m == nullptr) return nullptr;
    PyObject *capsule = PyCapsule_New(&fast_reads, TORCHLENS_FAST_READS_NAME, nullptr);
    if (capsule == nullptr || PyModule_AddObject(m, "fast_reads", capsule) < 0) {
        Py_XDECREF(capsule);
        Py_DECREF(m);
        return nullptr;
    }
    if (PyModule_AddIntConstant(m, "ABI", TORCHLENS_ACCEL_ABI) < 0 ||
        PyModule_AddStringConstant(m, "TORCH_VERSION", TORCHLENS_TORCH_VERSION) < 0) {
        Py_DECREF(m);
        return nullptr;
    }
    return m;
}
