/* Gradient capture's hooks as autograd's own C++ hooks: see torchlens/capture/grads.py.
 *
 * The one module of torchlens-accel built against torch's headers: it is built only where torch is
 * importable at build time, and used only with the torch it was built for (TORCH_VERSION).  A hook added
 * here is of the kind retain_grad() adds: a C++ tensor pre-hook on the output's backward node (a
 * ``NodeHook``, added to the node directly), which the engine calls with no Python frame and without the
 * GIL.  It writes into a C++ store that the Sink shares; the
 * Sink shows the store to Python as the Python path's _Sink does (grads, order, backwards).
 *
 * Sink       Sink(): the store.  .grads (a dict, rebuilt only after a hook wrote), .order, .backwards,
 *            .incomplete (records whose hook torch removed before a later backward, see below),
 *            .clear(), and .hook(index): a Python callable hook writing into the same store, for the
 *            tensors whose hooks stay Python (tensor subclasses).
 * HookAdder  HookAdder(sink, handles, numbers, keys, base, marker, plain, make_fallback, release):
 *            add_hook(index, t, func=None, module_call=-1) for a plain tensor that requires grad; any
 *            other call goes to the fallback, ``make_fallback(sink, handles, numbers, keys, base)``, made
 *            on the first such call (module-level callables: nothing is built per trace for them).
 *            .remove(indices=None) removes its hooks (all, or those of the records named); deleting it
 *            removes them all and, once the fallback was made, calls ``release(handles, keys, base)``
 *            (to remove the hooks the fallback added).
 *
 * A leaf (an input that requires grad) has no backward node of its own: its hooks sit in the tensor's
 * own hook list, which its gradient accumulator runs (in ``.backward()`` and in ``autograd.grad`` alike).
 * Its hook here is a ``LeafHook`` appended to that list, beside the one a Python hook dict adds, so that
 * the backward calls no Python for it.  torch empties that list when a hook dict is first set on the
 * tensor (its first Python ``register_hook``) or a C++ hook list is first made for it; a LeafHook
 * destroyed so while its tensor lives says so to the store, and a later backward then marks the record
 * incomplete (its gradient dropped, named in ``.incomplete``) rather than keep a gradient missing that
 * backward's share.
 *
 * Every step follows the Python path's ``_store`` and ``add_hook`` (tests/test_grads_accel.py compares
 * the three paths bit for bit).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <ATen/ops/add.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <atomic>
#include <memory>
#include <mutex>
#include <new>
#include <optional>
#include <utility>
#include <unordered_map>
#include <unordered_set>
#include <vector>

/* Bumped with torchlens.capture.accel.ABI whenever what is built here changes meaning. */
#define TORCHLENS_ACCEL_ABI 6

#ifndef TORCHLENS_TORCH_VERSION
#error "build with -DTORCHLENS_TORCH_VERSION=\"<torch.__version__>\" (accel/setup.py does)"
#endif

namespace {

/* ----- the store the hooks write into ------------------------------------------------------------ */
struct Store : std::enable_shared_from_this<Store> {
    std::mutex mutex;
    std::unordered_map<int64_t, at::Tensor> grads; /* record index -> accumulated gradient (detached) */
    std::vector<int64_t> order; /* record indices in the order their first gradient arrived */
    Py_ssize_t backwards = 0;
    bool has_task = false;
    int task = 0;               /* the graph task (one backward) delivering gradients here, until it ends */
    uint64_t version = 1;       /* bumped by every write to ``grads`` */
    uint64_t order_version = 1; /* bumped by every change of ``order`` */
    std::unordered_map<int64_t, Py_ssize_t> lost; /* record -> backwards seen when torch removed its hook */
    std::vector<int64_t> incomplete; /* lost records a later backward may have reached: gradient dropped */
    std::unordered_set<int64_t> guarded; /* leaves counted only in a backward that reached another record first */
    std::unordered_map<int64_t, at::Tensor> held; /* guarded leaf -> gradient from a backward run inside ``held_for`` */
    bool has_held_for = false;
    int held_for = 0;

    /* A leaf's hook was removed by torch, not by the capture (see the top of the file). */
    void lose(int64_t index) {
        std::lock_guard<std::mutex> lock(mutex);
        lost.emplace(index, backwards);
    }

    /* A leaf is watched again after torch removed its hook (the capture moves its hook behind one the user
     * registered in the forward, whose hook dict emptied the list): it missed nothing when no backward ran
     * since, and is no longer lost.  Whether it may be watched again. */
    bool rewatch(int64_t index) {
        std::lock_guard<std::mutex> lock(mutex);
        auto it = lost.find(index);
        if (it == lost.end()) return true;
        if (it->second != backwards) return false;
        lost.erase(it);
        return true;
    }

    /* A new backward began: a record that lost its hook before it cannot receive its share.  Called
     * with the lock held; what it drops goes to ``dropped``, released by the caller after the lock. */
    void drop_lost(std::vector<at::Tensor> &dropped) {
        for (auto it = lost.begin(); it != lost.end();) {
            if (it->second >= backwards) {
                ++it;
                continue;
            }
            auto kept = grads.find(it->first);
            if (kept != grads.end()) {
                dropped.push_back(std::move(kept->second));
                grads.erase(kept);
                version++;
            }
            incomplete.push_back(it->first);
            it = lost.erase(it);
        }
    }

    /* ``_store``: add ``grad`` to the gradient kept for record ``index``; never alters it.  No tensor is
     * released while the lock is held (releasing one may take the GIL, which a reader may hold while it
     * waits for the lock). */
    void add(int64_t index, const at::TensorBase &grad_base) {
        if (!grad_base.defined()) return; /* an output this backward did not reach */
        int current = torch::autograd::get_current_graph_task_id();
        at::Tensor grad(grad_base);
        if (grad.requires_grad()) grad = grad.detach(); /* create_graph=True: keep the value, not a graph */
        at::Tensor replaced;
        std::vector<at::Tensor> dropped;
        std::optional<size_t> first_of_backward;
        std::lock_guard<std::mutex> lock(mutex);
        if ((!has_task || current != task) && guarded.count(index)) {
            hold(index, grad, replaced, dropped); /* a leaf reached by a backward that reached nothing else here */
            return;
        }
        if (!has_task || current != task) {
            has_task = true;
            task = current;
            backwards++;
            if (!lost.empty()) drop_lost(dropped);
            first_of_backward = order.size();
        }
        if (first_of_backward) unshare_when_done(*first_of_backward, current);
        auto kept = grads.find(index);
        if (kept == grads.end()) {
            /* Kept by reference, not copied, as the Python path keeps it. */
            grads.emplace(index, std::move(grad));
            order.push_back(index);
            order_version++;
        } else {
            replaced = kept->second;
            kept->second = at::add(replaced, grad);
        }
        version++;
    }  /* the lock goes first, then ``replaced`` and ``dropped`` (declared before it) */

    /* grads.py's ``_hold``: a guarded leaf reached by a backward that reached no other record here is dropped
     * between the trace's backwards (a later forward's), and held while one runs (a backward run inside it, as a
     * reentrant checkpoint runs one), to be added when it ends.  Called with the lock held; the tensors it lets
     * go of go to ``replaced`` and ``dropped``, released by the caller after the lock. */
    void hold(int64_t index, const at::Tensor &grad, at::Tensor &replaced, std::vector<at::Tensor> &dropped) {
        if (!has_task) return;
        if (!has_held_for || held_for != task) { /* what is held for a backward that never ended (it raised) */
            for (auto &entry : held) dropped.push_back(std::move(entry.second));
            held.clear();
            has_held_for = true;
            held_for = task;
        }
        auto kept = held.find(index);
        if (kept == held.end()) {
            held.emplace(index, grad);
        } else {
            replaced = kept->second;
            kept->second = at::add(replaced, grad);
        }
    }

    /* grads.py's ``_Sink.settle``: the backward ``ended`` is over: add the leaf gradients held for it; no
     * backward of the trace runs now, until the next delivers. */
    void settle(int ended) {
        std::unordered_map<int64_t, at::Tensor> settled;
        std::vector<at::Tensor> replaced;
        std::lock_guard<std::mutex> lock(mutex);
        if (has_task && task == ended) has_task = false;
        if (!has_held_for || held_for != ended) return; /* (held for a backward still running that this one ran in) */
        settled.swap(held);
        has_held_for = false;
        for (auto &[index, grad] : settled) {
            auto kept = grads.find(index);
            if (kept == grads.end()) {
                grads.emplace(index, grad);
                order.push_back(index);
                order_version++;
            } else {
                replaced.push_back(kept->second);
                kept->second = at::add(kept->second, grad);
            }
            version++;
        }
    }  /* the lock goes first, then ``replaced`` and ``settled`` */

    /* grads.py's ``_unshare_when_done``: once this backward (``backward``) is over, settle it and copy each
     * gradient it kept first whose memory another tensor shares.  A view op's backward hands on a view of the
     * gradient the trace keeps, and autograd stores such a view as a leaf's ``.grad`` without copying it:
     * ``clip_grad_norm_`` or ``zero_()`` on that ``.grad`` would then rewrite the trace's record.  The callback
     * holds the store weakly: a store whose capture is gone has nothing to protect. */
    void unshare_when_done(size_t first, int backward) {
        std::weak_ptr<Store> weak = weak_from_this();
        try {
            torch::autograd::Engine::get_default_engine().queue_callback([weak, first, backward]() {
                if (auto store = weak.lock()) {
                    store->settle(backward);
                    store->unshare(first);
                }
            });
        } catch (const c10::Error &) {
            /* no backward is running (a hook called by hand): nothing to wait for */
        }
    }

    /* Copy the gradients kept first at ``order[first:]`` whose storage a tensor outside the trace holds.
     * Gradients of one backward may share a storage among themselves (a view op's gradient is a view of its
     * output's): those owners are counted out, since nothing writes the trace's gradients in place.  The
     * copies are made without the lock (a subclass's clone may take the GIL, which a reader may hold while
     * it waits for the lock), and a gradient a hook replaced meanwhile is left alone. */
    void unshare(size_t first) {
        std::vector<std::pair<int64_t, at::Tensor>> fresh, shared, copies;
        {
            std::lock_guard<std::mutex> lock(mutex);
            std::unordered_map<const c10::StorageImpl *, size_t> held; /* storage -> this backward's owners */
            std::unordered_set<const c10::TensorImpl *> ours, bases;
            for (size_t k = first; k < order.size(); k++) {
                auto kept = grads.find(order[k]);
                if (kept == grads.end() || !kept->second.has_storage()) continue;
                held[kept->second.storage().unsafeGetStorageImpl()]++;
                ours.insert(kept->second.unsafeGetTensorImpl());
                fresh.emplace_back(kept->first, kept->second);
            }
            for (auto &[index, grad] : fresh) { /* a view keeps its base alive: one owner more, ours too */
                if (!grad.is_view()) continue;
                const c10::TensorImpl *base = grad._base().unsafeGetTensorImpl();
                if (!ours.count(base) && bases.insert(base).second) held[grad.storage().unsafeGetStorageImpl()]++;
            }
            for (auto &[index, grad] : fresh)
                if (grad.storage().use_count() > held[grad.storage().unsafeGetStorageImpl()])
                    shared.emplace_back(index, grad);
        }
        for (auto &[index, grad] : shared) copies.emplace_back(index, grad.clone());
        std::vector<at::Tensor> replaced;
        std::lock_guard<std::mutex> lock(mutex);
        for (size_t k = 0; k < copies.size(); k++) {
            auto kept = grads.find(copies[k].first);
            if (kept == grads.end() || !kept->second.is_same(shared[k].second)) continue;
            replaced.push_back(std::move(kept->second));
            kept->second = std::move(copies[k].second);
            version++;
        }
    }  /* the lock goes first, then ``replaced``, ``copies``, ``shared`` and ``fresh`` */
};

using StorePtr = std::shared_ptr<Store>;

/* ----- Sink -------------------------------------------------------------------------------------- */
struct Sink {
    PyObject_HEAD
    StorePtr store;
    PyObject *grads;          /* the dict shown to Python, as of ``grads_version`` */
    uint64_t grads_version;
    PyObject *order;          /* the list shown to Python, as of ``order_version`` */
    uint64_t order_version;
};

PyTypeObject SinkType = {PyVarObject_HEAD_INIT(nullptr, 0)};

PyObject *sink_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    if (PyTuple_GET_SIZE(args) != 0 || (kwds != nullptr && PyDict_GET_SIZE(kwds) != 0)) {
        PyErr_SetString(PyExc_TypeError, "Sink() takes no arguments");
        return nullptr;
    }
    Sink *self = reinterpret_cast<Sink *>(type->tp_alloc(type, 0));
    if (self == nullptr) return nullptr;
    new (&self->store) StorePtr(std::make_shared<Store>());
    self->grads = PyDict_New();
    self->order = PyList_New(0);
    if (self->grads == nullptr || self->order == nullptr) {
        Py_DECREF(self);
        return nullptr;
    }
    self->grads_version = self->order_version = 1;
    return reinterpret_cast<PyObject *>(self);
}

void sink_dealloc(Sink *self) {
    Py_XDECREF(self->grads);
    Py_XDECREF(self->order);
    self->store.~StorePtr(); /* the hooks still in a graph keep their store; the tensors go with the last */
    Py_TYPE(self)->tp_free(reinterpret_cast<PyObject *>(self));
}

/* The dict of gradients, rebuilt from the store when a hook wrote since it was last built (a dict a
 * loaded trace filled stays as filled: no hook writes there). */
PyObject *sink_get_grads(Sink *self, void *) {
    std::vector<std::pair<int64_t, at::Tensor>> snapshot;
    uint64_t version;
    {
        std::lock_guard<std::mutex> lock(self->store->mutex);
        version = self->store->version;
        if (version != self->grads_version) snapshot.assign(self->store->grads.begin(), self->store->grads.end());
    }
    if (version != self->grads_version) {
        PyObject *grads = PyDict_New();
        if (grads == nullptr) return nullptr;
        for (const auto &entry : snapshot) {
            PyObject *key = PyLong_FromLongLong(entry.first);
            PyObject *value = key == nullptr ? nullptr : THPVariable_Wrap(entry.second);
            int failed = value == nullptr || PyDict_SetItem(grads, key, value) < 0;
            Py_XDECREF(key);
            Py_XDECREF(value);
            if (failed) {
                Py_DECREF(grads);
                return nullptr;
            }
        }
        Py_SETREF(self->grads, grads);
        self->grads_version = version;
    }
    Py_INCREF(self->grads);
    return self->grads;
}

PyObject *sink_get_order(Sink *self, void *) {
    std::lock_guard<std::mutex> lock(self->store->mutex);
    Store &store = *self->store;
    if (store.order_version != self->order_version) {
        PyObject *order = PyList_New(static_cast<Py_ssize_t>(store.order.size()));
        if (order == nullptr) return nullptr;
        for (size_t k = 0; k < store.order.size(); k++) {
            PyObject *index = PyLong_FromLongLong(store.order[k]);
            if (index == nullptr) {
                Py_DECREF(order);
                return nullptr;
            }
            PyList_SET_ITEM(order, static_cast<Py_ssize_t>(k), index);
        }
        Py_SETREF(self->order, order);
        self->order_version = store.order_version;
    }
    Py_INCREF(self->order);
    return self->order;
}

int sink_set_order(Sink *self, PyObject *value, void *) {
    if (value == nullptr || !PyList_CheckExact(value)) {
        PyErr_SetString(PyExc_TypeError, "Sink.order must be a list");
        return -1;
    }
    std::vector<int64_t> order;
    for (Py_ssize_t k = 0; k < PyList_GET_SIZE(value); k++) {
        long long index = PyLong_AsLongLong(PyList_GET_ITEM(value, k));
        if (index == -1 && PyErr_Occurred()) return -1;
        order.push_back(index);
    }
    std::lock_guard<std::mutex> lock(self->store->mutex);
    self->store->order = std::move(order);
    self->store->order_version++;
    return 0;
}

PyObject *sink_get_incomplete(Sink *self, void *) {
    std::lock_guard<std::mutex> lock(self->store->mutex);
    const auto &incomplete = self->store->incomplete;
    PyObject *indices = PyFrozenSet_New(nullptr);
    for (size_t k = 0; indices != nullptr && k < incomplete.size(); k++) {
        PyObject *index = PyLong_FromLongLong(incomplete[k]);
        if (index == nullptr || PySet_Add(indices, index) < 0) Py_CLEAR(indices);
        Py_XDECREF(index);
    }
    return indices;
}

PyObject *sink_get_backwards(Sink *self, void *) {
    std::lock_guard<std::mutex> lock(self->store->mutex);
    return PyLong_FromSsize_t(self->store->backwards);
}

int sink_set_backwards(Sink *self, PyObject *value, void *) {
    Py_ssize_t n = value == nullptr ? -1 : PyLong_AsSsize_t(value);
    if (n == -1 && (value == nullptr || PyErr_Occurred())) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "Sink.backwards must be an int");
        return -1;
    }
    std::lock_guard<std::mutex> lock(self->store->mutex);
    self->store->backwards = n;
    return 0;
}

/* Release every gradient (``Trace.cleanup``); the order and the count stay. */
PyObject *sink_clear(Sink *self, PyObject *) {
    std::unordered_map<int64_t, at::Tensor> released;
    uint64_t version;
    {
        std::lock_guard<std::mutex> lock(self->store->mutex);
        released.swap(self->store->grads);
        version = ++self->store->version;
    }
    PyDict_Clear(self->grads);
    self->grads_version = version;
    Py_RETURN_NONE; /* ``released`` frees the tensors here, outside the lock */
}

/* grads.py's ``_Sink.guard``: the records whose gradients count only in a backward that has already
 * delivered a gradient here. */
PyObject *sink_guard(Sink *self, PyObject *indices) {
    PyObject *iterator = PyObject_GetIter(indices);
    if (iterator == nullptr) return nullptr;
    std::unordered_set<int64_t> guarded;
    while (PyObject *index = PyIter_Next(iterator)) {
        long long i = PyLong_AsLongLong(index);
        Py_DECREF(index);
        if (i == -1 && PyErr_Occurred()) break;
        guarded.insert(i);
    }
    Py_DECREF(iterator);
    if (PyErr_Occurred()) return nullptr;
    std::lock_guard<std::mutex> lock(self->store->mutex);
    self->store->guarded = std::move(guarded);
    Py_RETURN_NONE;
}

PyObject *make_py_hook(Sink *sink, long long index);

PyObject *sink_hook(Sink *self, PyObject *index) {
    long long i = PyLong_AsLongLong(index);
    if (i == -1 && PyErr_Occurred()) return nullptr;
    return make_py_hook(self, i);
}

PyGetSetDef sink_getset[] = {
    {"grads", (getter)sink_get_grads, nullptr, "record index -> accumulated gradient", nullptr},
    {"order", (getter)sink_get_order, (setter)sink_set_order, "record indices in backward order", nullptr},
    {"backwards", (getter)sink_get_backwards, (setter)sink_set_backwards, "backwards that delivered a gradient",
     nullptr},
    {"incomplete", (getter)sink_get_incomplete, nullptr,
     "records whose gradient was dropped: torch removed their hook before a later backward", nullptr},
    {nullptr},
};

PyMethodDef sink_methods[] = {
    {"clear", (PyCFunction)sink_clear, METH_NOARGS, "Release every gradient (the order and the count stay)."},
    {"hook", (PyCFunction)sink_hook, METH_O, "hook(index): a Python tensor hook writing into this sink."},
    {"guard", (PyCFunction)sink_guard, METH_O,
     "guard(indices): leaves counted only in a backward that reached another record first."},
    {nullptr},
};

/* ----- the Python hook, for the tensors whose hooks stay Python ----------------------------------- */
struct PyHook {
    PyObject_HEAD
    StorePtr store;
    long long index;
    vectorcallfunc vectorcall;
};

PyTypeObject PyHookType = {PyVarObject_HEAD_INIT(nullptr, 0)};

PyObject *py_hook_vectorcall(PyHook *self, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    if (PyVectorcall_NARGS(nargsf) != 1 || (kwnames != nullptr && PyTuple_GET_SIZE(kwnames) != 0)) {
        PyErr_SetString(PyExc_TypeError, "a gradient hook takes one argument, the gradient");
        return nullptr;
    }
    PyObject *grad = args[0];
    if (grad != Py_None) {
        if (!THPVariable_Check(grad)) {
            PyErr_SetString(PyExc_TypeError, "a gradient hook was handed something other than a tensor");
            return nullptr;
        }
        try {
            self->store->add(self->index, THPVariable_Unpack(grad));
        } catch (const std::exception &e) {
            PyErr_SetString(PyExc_RuntimeError, e.what());
            return nullptr;
        }
    }
    Py_RETURN_NONE;
}

void py_hook_dealloc(PyHook *self) {
    self->store.~StorePtr();
    PyObject_Free(self);
}

PyObject *make_py_hook(Sink *sink, long long index) {
    PyHook *hook = PyObject_New(PyHook, &PyHookType);
    if (hook == nullptr) return nullptr;
    new (&hook->store) StorePtr(sink->store);
    hook->index = index;
    hook->vectorcall = (vectorcallfunc)py_hook_vectorcall;
    return reinterpret_cast<PyObject *>(hook);
}

/* ----- a leaf's hook ------------------------------------------------------------------------------ */
/* What a leaf's hook and its adder share: the tensor (weakly) and whether the capture removed the hook. */
struct LeafLink {
    explicit LeafLink(const c10::intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl> &impl) : tensor(impl) {}
    c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl> tensor;
    torch::autograd::FunctionPreHook *hook = nullptr;
    std::atomic<bool> removed{false};
};

/* Compiled autograd (torch._dynamo.compiled_autograd) asks each hook to describe itself so that it can be
 * traced into the compiled backward; these hooks cannot be: say so, with what to do, instead of torch's
 * generic "compiled_args nyi" (the pure-Python path's hooks are Python tensor hooks, which it traces). */
void refuse_compiled_autograd() {
    TORCH_CHECK_NOT_IMPLEMENTED(false,
        "torchlens: the gradient capture of torchlens-accel (its C++ hooks) cannot run under compiled autograd "
        "(torch._dynamo.compiled_autograd); run this backward without compiled autograd, or trace with "
        "TORCHLENS_ACCEL=0, whose Python hooks compiled autograd can trace");
}

struct LeafHook : torch::autograd::FunctionPreHook {
    LeafHook(StorePtr store, int64_t record, std::shared_ptr<LeafLink> link)
        : store(std::move(store)), record(record), link(std::move(link)) {}

    torch::autograd::variable_list operator()(const torch::autograd::variable_list &grads) override {
        if (!grads.empty()) store->add(record, grads[0]);
        return grads; /* the gradient as it came */
    }

    void compiled_args(torch::dynamo::autograd::CompiledNodeArgs &) const override { refuse_compiled_autograd(); }

    /* Destroyed by the capture (``removed``), with its tensor (nothing more can arrive), or by torch
     * emptying the tensor's hook list while it lives: only the last loses gradients. */
    ~LeafHook() override {
        if (!link->removed.load() && link->tensor.lock().defined()) store->lose(record);
    }

    StorePtr store;
    int64_t record;
    std::shared_ptr<LeafLink> link;
};

/* ----- an output's hook, on its backward node ----------------------------------------------------- */
/* Of the kind torch's own C++ tensor hook is (the node runs it with the gradients of all its outputs
 * and it reads its own), added straight to the node: one object per hook, not the tensor's hook list,
 * its two wrappers and a std::function.  torch moves no node hook on an in-place write: the hook stays
 * with the node that computed the value, as register_hook's does. */
struct NodeHook : torch::autograd::FunctionPreHook {
    NodeHook(StorePtr store, int64_t record, uint32_t output_nr)
        : store(std::move(store)), record(record), output_nr(output_nr) {}

    torch::autograd::variable_list operator()(const torch::autograd::variable_list &grads) override {
        if (output_nr < grads.size()) store->add(record, grads[output_nr]);
        return grads; /* the gradients as they came */
    }

    void compiled_args(torch::dynamo::autograd::CompiledNodeArgs &) const override { refuse_compiled_autograd(); }

    StorePtr store;
    int64_t record;
    uint32_t output_nr;
};

/* Take ``hook`` out of ``hooks`` if there; it is destroyed after the list is whole again. */
void take_out(std::vector<std::unique_ptr<torch::autograd::FunctionPreHook>> &hooks,
              const torch::autograd::FunctionPreHook *hook) {
    auto found = std::find_if(hooks.begin(), hooks.end(), [&](const auto &h) { return h.get() == hook; });
    if (found == hooks.end()) return;
    std::unique_ptr<torch::autograd::FunctionPreHook> gone = std::move(*found);
    hooks.erase(found);
}

/* Remove a leaf's hook from its tensor's hook list, if the tensor and the hook are still there. */
void remove_leaf(const std::shared_ptr<LeafLink> &link) {
    link->removed.store(true);
    auto impl = link->tensor.lock();
    if (!impl.defined()) return;
    at::Tensor tensor(std::move(impl));
    take_out(torch::autograd::impl::hooks(tensor), link->hook);
}

/* ----- HookAdder ---------------------------------------------------------------------------------- */
/* Where one added hook sits: on its backward node, held weakly (the hook is removable for as long as
 * the node could run it, and a node gone took its hooks with it), or, for a leaf, in the tensor's own
 * hook list, found through its ``leaf`` link. */
struct Placed {
    std::optional<c10::weak_intrusive_ptr<torch::autograd::Node>> node;
    const torch::autograd::FunctionPreHook *hook;
    std::shared_ptr<LeafLink> leaf;
};

struct HookAdder {
    PyObject_HEAD
    StorePtr store;
    std::unordered_map<int64_t, Placed> placed; /* record index -> its hook */
    PyObject *sink;
    PyObject *handles;  /* record index -> ``marker`` for the hooks placed here (the capture's record of hooks) */
    PyObject *numbers;  /* record index -> sequence number of its backward node */
    PyObject *keys;     /* record index -> hook key, for the fallback's hooks */
    PyObject *base;     /* the capture's key base, for the fallback's hooks */
    PyObject *marker;
    PyObject *plain;    /* torch.Tensor: the type whose hooks are placed here */
    PyObject *make_fallback;
    PyObject *release;  /* removes the fallback's hooks; called on deletion once the fallback was made */
    PyObject *fallback; /* the Python add_hook, for every other call: NULL until first needed */
    vectorcallfunc vectorcall;
};

PyTypeObject HookAdderType = {PyVarObject_HEAD_INIT(nullptr, 0)};

void unplace(Placed &placed) {
    if (placed.leaf) {
        remove_leaf(placed.leaf);
        return;
    }
    if (!placed.node) return;
    auto node = placed.node->lock();
    if (node) take_out(node->tensor_pre_hooks(), placed.hook);
}

void remove_placed(HookAdder *self, int64_t index) {
    auto found = self->placed.find(index);
    if (found == self->placed.end()) return;
    unplace(found->second);
    self->placed.erase(found);
}

void remove_all_placed(HookAdder *self) {
    for (auto &entry : self->placed) unplace(entry.second);
    self->placed.clear();
}

PyObject *adder_vectorcall(HookAdder *self, PyObject *const *args, size_t nargsf, PyObject *kwnames);

PyObject *adder_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    PyObject *sink, *handles, *numbers, *keys, *base, *marker, *plain, *make_fallback, *release;
    if ((kwds != nullptr && PyDict_GET_SIZE(kwds) != 0) ||
        !PyArg_ParseTuple(args, "O!O!O!O!OOOOO:HookAdder", &SinkType, &sink, &PyDict_Type, &handles, &PyDict_Type,
                          &numbers, &PyDict_Type, &keys, &base, &marker, &plain, &make_fallback, &release)) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "HookAdder() takes positional arguments only");
        return nullptr;
    }
    HookAdder *self = reinterpret_cast<HookAdder *>(type->tp_alloc(type, 0));
    if (self == nullptr) return nullptr;
    new (&self->store) StorePtr(reinterpret_cast<Sink *>(sink)->store);
    new (&self->placed) std::unordered_map<int64_t, Placed>();
    PyObject **slots[] = {&self->sink, &self->handles, &self->numbers, &self->keys, &self->base, &self->marker,
                          &self->plain, &self->make_fallback, &self->release};
    PyObject *values[] = {sink, handles, numbers, keys, base, marker, plain, make_fallback, release};
    for (size_t k = 0; k < sizeof(values) / sizeof(values[0]); k++) {
        Py_INCREF(values[k]);
        *slots[k] = values[k];
    }
    self->fallback = nullptr;
    self->vectorcall = (vectorcallfunc)adder_vectorcall;
    return reinterpret_cast<PyObject *>(self);
}

void adder_dealloc(HookAdder *self) {
    /* May run while an exception propagates (the trace dropped by an unwinding frame): keep it. */
    PyObject *type, *value, *traceback;
    PyErr_Fetch(&type, &value, &traceback);
    remove_all_placed(self);
    if (self->fallback != nullptr) {
        PyObject *r = PyObject_CallFunctionObjArgs(self->release, self->handles, self->keys, self->base, nullptr);
        if (r == nullptr) PyErr_WriteUnraisable(nullptr);
        Py_XDECREF(r);
    }
    PyErr_Restore(type, value, traceback);
    self->placed.~unordered_map();
    self->store.~StorePtr();
    Py_DECREF(self->sink);
    Py_DECREF(self->handles);
    Py_DECREF(self->numbers);
    Py_DECREF(self->keys);
    Py_DECREF(self->base);
    Py_DECREF(self->marker);
    Py_DECREF(self->plain);
    Py_DECREF(self->make_fallback);
    Py_DECREF(self->release);
    Py_XDECREF(self->fallback);
    Py_TYPE(self)->tp_free(reinterpret_cast<PyObject *>(self));
}

/* A leaf's hook, appended to its tensor's own hook list.  1 placed, -1 on error. */
int place_leaf(HookAdder *self, PyObject *index, int64_t record, const at::Tensor &var) {
    auto link = std::make_shared<LeafLink>(var.getIntrusivePtr());
    auto hook = std::make_unique<LeafHook>(self->store, record, link);
    link->hook = hook.get();
    remove_placed(self, record); /* a record watched again (rewatch) keeps one hook */
    if (!self->store->rewatch(record)) return 1; /* a backward missed it: it stays lost (``incomplete``) */
    /* Appended to the list itself: ``impl::add_hook`` takes only an empty list (the one hook a Python
     * hook dict or a C++ hook list adds), and the accumulator runs every hook the list holds. */
    torch::autograd::impl::hooks(var).push_back(std::move(hook));
    self->placed.emplace(record, Placed{std::nullopt, nullptr, std::move(link)});
    return PyDict_SetItem(self->handles, index, self->marker) < 0 ? -1 : 1;
}

/* The hook of a plain tensor that requires grad: 1 placed, 0 for the fallback, -1 on error. */
int place(HookAdder *self, PyObject *index, PyObject *t) {
    long long i = PyLong_AsLongLong(index);
    if (i == -1 && PyErr_Occurred()) return -1;
    const at::Tensor &var = THPVariable_Unpack(t);
    if (!var.requires_grad()) return 0; /* the fallback says what register_hook says */
    const auto &node = var.grad_fn();
    if (!node) return place_leaf(self, index, i, var); /* no sequence number: a leaf has no backward node */
    PyObject *number = PyLong_FromUnsignedLongLong(node->sequence_nr());
    if (number == nullptr) return -1;
    remove_placed(self, i); /* a record watched again (rewatch) keeps one hook */
    auto hook = std::make_unique<NodeHook>(self->store, i, var.output_nr());
    const torch::autograd::FunctionPreHook *placed = hook.get();
    node->add_tensor_pre_hook(std::move(hook));
    self->placed.emplace(i, Placed{c10::weak_intrusive_ptr<torch::autograd::Node>(node), placed, nullptr});
    int failed = PyDict_SetItem(self->handles, index, self->marker) < 0 ||
                 PyDict_SetItem(self->numbers, index, number) < 0;
    Py_DECREF(number);
    return failed ? -1 : 1;
}

PyObject *adder_vectorcall(HookAdder *self, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    Py_ssize_t n = PyVectorcall_NARGS(nargsf);
    if (kwnames == nullptr && n >= 2 && n <= 4 && PyLong_CheckExact(args[0]) &&
        reinterpret_cast<PyObject *>(Py_TYPE(args[1])) == self->plain) {
        int placed;
        try {
            placed = place(self, args[0], args[1]);
        } catch (const std::exception &e) {
            PyErr_SetString(PyExc_RuntimeError, e.what());
            return nullptr;
        }
        if (placed < 0) return nullptr;
        if (placed) Py_RETURN_NONE;
    }
    if (self->fallback == nullptr) {
        self->fallback = PyObject_CallFunctionObjArgs(self->make_fallback, self->sink, self->handles, self->numbers,
                                                      self->keys, self->base, nullptr);
        if (self->fallback == nullptr) return nullptr;
    }
    return PyObject_Vectorcall(self->fallback, args, nargsf, kwnames);
}

/* remove(indices=None): remove the hooks placed here, of every record or of the records named. */
PyObject *adder_remove(HookAdder *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs > 1) {
        PyErr_SetString(PyExc_TypeError, "remove(indices=None)");
        return nullptr;
    }
    if (nargs == 0 || args[0] == Py_None) {
        remove_all_placed(self);
        Py_RETURN_NONE;
    }
    PyObject *iter = PyObject_GetIter(args[0]);
    if (iter == nullptr) return nullptr;
    PyObject *item;
    while ((item = PyIter_Next(iter)) != nullptr) {
        long long i = PyLong_AsLongLong(item);
        Py_DECREF(item);
        if (i == -1 && PyErr_Occurred()) break;
        remove_placed(self, i);
    }
    Py_DECREF(iter);
    if (PyErr_Occurred()) return nullptr;
    Py_RETURN_NONE;
}

PyObject *adder_placed(HookAdder *self, PyObject *) {
    return PyLong_FromSize_t(self->placed.size());
}

PyMethodDef adder_methods[] = {
    {"remove", (PyCFunction)(void (*)(void))adder_remove, METH_FASTCALL,
     "remove(indices=None): remove the hooks placed here (all, or those of the records named)."},
    {"placed", (PyCFunction)adder_placed, METH_NOARGS, "How many hooks placed here are in place."},
    {nullptr},
};

PyModuleDef autograd_module = {PyModuleDef_HEAD_INIT, "_autograd",
                               "torchlens's gradient-capture hooks as autograd C++ hooks.", -1, nullptr};

}  // namespace

PyMODINIT_FUNC PyInit__autograd(void) {
    SinkType.tp_name = "torchlens_accel._autograd.Sink";
    SinkType.tp_doc = "What the gradient hooks write into: Sink().";
    SinkType.tp_basicsize = sizeof(Sink);
    SinkType.tp_flags = Py_TPFLAGS_DEFAULT;
    SinkType.tp_new = sink_new;
    SinkType.tp_dealloc = (destructor)sink_dealloc;
    SinkType.tp_getset = sink_getset;
    SinkType.tp_methods = sink_methods;

    PyHookType.tp_name = "torchlens_accel._autograd.PyHook";
    PyHookType.tp_doc = "sink.hook(index): the Python tensor hook keeping record index's gradient in sink.";
    PyHookType.tp_basicsize = sizeof(PyHook);
    PyHookType.tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_VECTORCALL;
    PyHookType.tp_dealloc = (destructor)py_hook_dealloc;
    PyHookType.tp_call = PyVectorcall_Call;
    PyHookType.tp_vectorcall_offset = offsetof(PyHook, vectorcall);

    HookAdderType.tp_name = "torchlens_accel._autograd.HookAdder";
    HookAdderType.tp_doc = "HookAdder(sink, handles, numbers, keys, base, marker, plain, make_fallback, release): "
                           "add_hook(index, t, func=None, module_call=-1); removes its hooks when deleted.";
    HookAdderType.tp_basicsize = sizeof(HookAdder);
    HookAdderType.tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_VECTORCALL;
    HookAdderType.tp_new = adder_new;
    HookAdderType.tp_dealloc = (destructor)adder_dealloc;
    HookAdderType.tp_call = PyVectorcall_Call;
    HookAdderType.tp_vectorcall_offset = offsetof(HookAdder, vectorcall);
    HookAdderType.tp_methods = adder_methods;

    if (PyType_Ready(&SinkType) < 0 || PyType_Ready(&PyHookType) < 0 || PyType_Ready(&HookAdderType) < 0)
        return nullptr;
    PyObject *m = PyModule_Create(&autograd_module);
    if (m == nullptr) return nullptr;
    if (PyModule_AddIntConstant(m, "ABI", TORCHLENS_ACCEL_ABI) < 0 ||
        PyModule_AddStringConstant(m, "TORCH_VERSION", TORCHLENS_TORCH_VERSION) < 0 ||
        PyModule_AddObjectRef(m, "Sink", reinterpret_cast<PyObject *>(&SinkType)) < 0 ||
        PyModule_AddObjectRef(m, "HookAdder", reinterpret_cast<PyObject *>(&HookAdderType)) < 0) {
        Py_DECREF(m);
        return nullptr;
    }
    return m;
}
