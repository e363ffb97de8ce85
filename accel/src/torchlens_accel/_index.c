/* The model-structure check in C: see torchlens/record/model_index.py, whose Structure this follows.
 *
 * Snapshot(model, modules, versions=True)  what a model's index was derived from: the root and every
 *            module (``modules``, the root excluded, each once), their three dicts ``_modules``,
 *            ``_parameters`` and ``_buffers``, and every key and value of those dicts.  The modules,
 *            the dicts, their keys and their values are held strongly, so none of them can be freed
 *            and its address reused by a different object that would then pass for it; a module's
 *            ``__dict__`` is not held (the root's may hold the root itself, through a bound method or
 *            a closure), so it is found again on every check.
 * unchanged(model)  whether model's module tree is exactly what was snapshotted: every module of the
 *            same class, the same dict objects under the same three names of every ``__dict__``, each
 *            with the same keys (equal, in order) and the same values (identical, in order).
 *
 * Raises TypeError (a module without a ``__dict__``, or keeping its submodules, parameters or buffers in
 * a custom mapping) or KeyError (a module without the usual dicts), as Structure does: never cached.
 *
 * On CPython 3.11, every dict carries a version tag, drawn from one global counter whenever
 * the dict is created or changes an entry (PEP 509): an equal tag on the same dict means nothing in it
 * changed, so the check compares one tag per dict where nothing changed instead of every entry.  A tag
 * that differs (a write of an equal entry, a watcher added) falls back to comparing the entries, and
 * remembers the tag when they agree.  OrderedDicts never take that shortcut: their own order
 * (``move_to_end``) lives outside the dict's table and its tag.  Other versions compare every entry.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

/* Bumped with torchlens.capture.accel.ABI whenever what is built here changes meaning. */
#define TORCHLENS_ACCEL_ABI 2

/* Only where it is built and tested: CPython 3.11 (3.12 deprecates the tag and folds watcher bits into it). */
#if PY_VERSION_HEX >= 0x030B0000 && PY_VERSION_HEX < 0x030C0000
#define HAVE_DICT_VERSIONS 1
_Py_COMP_DIAG_PUSH
_Py_COMP_DIAG_IGNORE_DEPR_DECLS
static inline uint64_t dict_version(PyObject *d) { return ((PyDictObject *)d)->ma_version_tag; }
_Py_COMP_DIAG_POP
#else
#define HAVE_DICT_VERSIONS 0
static inline uint64_t dict_version(PyObject *d) { (void)d; return 0; }
#endif

#define KINDS 3 /* _modules, _parameters, _buffers: the three dicts of every module */
static PyObject *kind_names[KINDS];

typedef struct {
    PyObject_HEAD
    Py_ssize_t owners;      /* the root and every module */
    PyObject *modules;      /* a tuple: every module but the root, in walk order */
    PyObject **classes;     /* per owner: its class when snapshotted (``__class__`` can be assigned) */
    PyObject **dicts;       /* owners * KINDS dicts, the root's first */
    char *ordered;          /* per dict: an OrderedDict (keys in its own order) */
    Py_ssize_t *offsets;    /* per dict, then one more: where its entries start in ``entries`` */
    PyObject **entries;     /* key, value, key, value, ... of every dict in turn */
    int versions;           /* whether the tag shortcut is in use */
    void **owner_dicts;     /* the address of each owner's __dict__ when last checked (never dereferenced) */
    uint64_t *owner_versions;
    uint64_t *dict_versions;
} Snapshot;

/* ----- reading a module's three dicts -------------------------------------------------------- */

/* The owner's __dict__ (a new reference), or NULL with an exception set. */
static PyObject *instance_dict(PyObject *owner) {
    return PyObject_GenericGetDict(owner, NULL);
}

/* The dict stored under kind_names[kind] in the owner's __dict__ ``d`` (a new reference), or NULL with
 * an exception set.  A __dict__ of a dict subclass is read through its own __getitem__, as vars() is. */
static PyObject *kind_dict(PyObject *d, int kind) {
    if (!PyDict_CheckExact(d)) return PyObject_GetItem(d, kind_names[kind]);
    PyObject *sub = PyDict_GetItemWithError(d, kind_names[kind]);
    if (sub == NULL && !PyErr_Occurred()) PyErr_SetObject(PyExc_KeyError, kind_names[kind]);
    Py_XINCREF(sub);
    return sub;
}

static int same_key(PyObject *now, PyObject *then) {
    if (now == then) return 1;
    if (PyUnicode_CheckExact(now) && PyUnicode_CheckExact(then)) return PyUnicode_Compare(now, then) == 0;
    Py_INCREF(now); /* an __eq__ of ours could drop the dict's last reference to it */
    int equal = PyObject_RichCompareBool(now, then, Py_EQ);
    Py_DECREF(now);
    if (equal < 0) { /* a key that cannot be compared: taken as changed */
        PyErr_Clear();
        return 0;
    }
    return equal;
}

/* Whether dict number k holds exactly the snapshotted entries, in order. */
static int entries_equal(Snapshot *self, Py_ssize_t k) {
    PyObject *d = self->dicts[k];
    PyObject **entry = self->entries + 2 * self->offsets[k];
    Py_ssize_t size = self->offsets[k + 1] - self->offsets[k];
    if (PyDict_GET_SIZE(d) != size) return 0;
    if (!self->ordered[k]) {
        Py_ssize_t pos = 0;
        PyObject *key, *value;
        for (Py_ssize_t i = 0; PyDict_Next(d, &pos, &key, &value); i++) {
            if (i >= size || value != entry[2 * i + 1] || !same_key(key, entry[2 * i])) return 0;
        }
        return 1;
    }
    PyObject *keys = PySequence_List(d); /* an OrderedDict's keys, in its own order */
    if (keys == NULL) {
        PyErr_Clear();
        return 0;
    }
    int equal = PyList_GET_SIZE(keys) == size;
    for (Py_ssize_t i = 0; equal && i < size; i++) {
        PyObject *key = PyList_GET_ITEM(keys, i);
        PyObject *value = PyDict_GetItemWithError(d, key);
        equal = value == entry[2 * i + 1] && same_key(key, entry[2 * i]);
    }
    Py_DECREF(keys);
    PyErr_Clear();
    return equal;
}

/* ----- Snapshot ------------------------------------------------------------------------------ */

static int snapshot_traverse(Snapshot *self, visitproc visit, void *arg) {
    Py_VISIT(self->modules);
    if (self->classes != NULL)
        for (Py_ssize_t i = 0; i < self->owners; i++) Py_VISIT(self->classes[i]);
    if (self->dicts != NULL)
        for (Py_ssize_t k = 0; k < self->owners * KINDS; k++) Py_VISIT(self->dicts[k]);
    if (self->entries != NULL && self->offsets != NULL)
        for (Py_ssize_t i = 0; i < 2 * self->offsets[self->owners * KINDS]; i++) Py_VISIT(self->entries[i]);
    return 0;
}

static int snapshot_clear(Snapshot *self) {
    if (self->entries != NULL && self->offsets != NULL)
        for (Py_ssize_t i = 0; i < 2 * self->offsets[self->owners * KINDS]; i++) Py_CLEAR(self->entries[i]);
    if (self->dicts != NULL)
        for (Py_ssize_t k = 0; k < self->owners * KINDS; k++) Py_CLEAR(self->dicts[k]);
    if (self->classes != NULL)
        for (Py_ssize_t i = 0; i < self->owners; i++) Py_CLEAR(self->classes[i]);
    Py_CLEAR(self->modules);
    return 0;
}

static void snapshot_dealloc(Snapshot *self) {
    PyObject_GC_UnTrack(self);
    snapshot_clear(self);
    PyMem_Free(self->classes);
    PyMem_Free(self->dicts);
    PyMem_Free(self->ordered);
    PyMem_Free(self->offsets);
    PyMem_Free(self->entries);
    PyMem_Free(self->owner_dicts);
    PyMem_Free(self->owner_versions);
    PyMem_Free(self->dict_versions);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *owner_at(Snapshot *self, PyObject *model, Py_ssize_t i) {
    return i == 0 ? model : PyTuple_GET_ITEM(self->modules, i - 1);
}

/* Find every owner's three dicts (strong references into self->dicts) and count their entries. */
static int take_dicts(Snapshot *self, PyObject *model) {
    for (Py_ssize_t i = 0; i < self->owners; i++) {
        self->classes[i] = Py_NewRef((PyObject *)Py_TYPE(owner_at(self, model, i)));
        PyObject *d = instance_dict(owner_at(self, model, i));
        if (d == NULL) {
            if (PyErr_ExceptionMatches(PyExc_AttributeError)) { /* never cached, as Structure's vars() */
                PyErr_Clear();
                PyErr_SetString(PyExc_TypeError, "a module has no __dict__");
            }
            return -1;
        }
        self->owner_dicts[i] = d;
        self->owner_versions[i] = dict_version(d);
        for (int kind = 0; kind < KINDS; kind++) {
            Py_ssize_t k = i * KINDS + kind;
            PyObject *sub = kind_dict(d, kind);
            if (sub == NULL) {
                Py_DECREF(d);
                return -1;
            }
            self->dicts[k] = sub;
            if (!PyDict_CheckExact(sub) && !PyODict_CheckExact(sub)) { /* whose entries are its own */
                Py_DECREF(d);
                PyErr_SetString(PyExc_TypeError,
                                "a module keeps its submodules, parameters or buffers in a custom mapping");
                return -1;
            }
            self->ordered[k] = !PyDict_CheckExact(sub);
            self->dict_versions[k] = dict_version(sub);
            self->offsets[k + 1] = self->offsets[k] + PyDict_GET_SIZE(sub);
        }
        Py_DECREF(d);
    }
    return 0;
}

/* Copy every dict's entries, in order, into self->entries (strong references). */
static int take_entries(Snapshot *self) {
    Py_ssize_t total = self->offsets[self->owners * KINDS];
    self->entries = PyMem_Calloc(2 * total + 1, sizeof(PyObject *));
    if (self->entries == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t k = 0; k < self->owners * KINDS; k++) {
        PyObject *d = self->dicts[k];
        PyObject **entry = self->entries + 2 * self->offsets[k];
        PyObject *keys = self->ordered[k] ? PySequence_List(d) : PyDict_Keys(d);
        if (keys == NULL) return -1;
        if (PyList_GET_SIZE(keys) != self->offsets[k + 1] - self->offsets[k]) {
            Py_DECREF(keys);
            PyErr_SetString(PyExc_RuntimeError, "a module's dict changed while it was snapshotted");
            return -1;
        }
        for (Py_ssize_t i = 0; i < PyList_GET_SIZE(keys); i++) {
            PyObject *key = PyList_GET_ITEM(keys, i);
            PyObject *value = PyDict_GetItemWithError(d, key);
            if (value == NULL) {
                Py_DECREF(keys);
                if (!PyErr_Occurred()) PyErr_SetString(PyExc_RuntimeError, "a module's dict changed while it was snapshotted");
                return -1;
            }
            Py_INCREF(key);
            Py_INCREF(value);
            entry[2 * i] = key;
            entry[2 * i + 1] = value;
        }
        Py_DECREF(keys);
    }
    return 0;
}

static PyObject *snapshot_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    PyObject *model, *modules;
    int versions = 1;
    static char *kwlist[] = {"model", "modules", "versions", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OO|p:Snapshot", kwlist, &model, &modules, &versions)) return NULL;
    Snapshot *self = (Snapshot *)type->tp_alloc(type, 0);
    if (self == NULL) return NULL;
    self->versions = versions && HAVE_DICT_VERSIONS;
    self->modules = PySequence_Tuple(modules);
    if (self->modules == NULL) goto fail;
    self->owners = PyTuple_GET_SIZE(self->modules) + 1;
    Py_ssize_t count = self->owners * KINDS;
    self->classes = PyMem_Calloc(self->owners, sizeof(PyObject *));
    self->dicts = PyMem_Calloc(count, sizeof(PyObject *));
    self->ordered = PyMem_Calloc(count, 1);
    self->offsets = PyMem_Calloc(count + 1, sizeof(Py_ssize_t));
    self->owner_dicts = PyMem_Calloc(self->owners, sizeof(void *));
    self->owner_versions = PyMem_Calloc(self->owners, sizeof(uint64_t));
    self->dict_versions = PyMem_Calloc(count, sizeof(uint64_t));
    if (self->classes == NULL || self->dicts == NULL || self->ordered == NULL || self->offsets == NULL || self->owner_dicts == NULL ||
        self->owner_versions == NULL || self->dict_versions == NULL) {
        PyErr_NoMemory();
        goto fail;
    }
    if (take_dicts(self, model) < 0 || take_entries(self) < 0) goto fail;
    return (PyObject *)self;
fail:
    Py_DECREF(self);
    return NULL;
}

/* Whether owner i's three dicts are still the snapshotted ones, each with the same entries; -1 on an
 * error to propagate (none: every failure to read reads as a change). */
static int owner_unchanged(Snapshot *self, PyObject *owner, Py_ssize_t i) {
    if ((PyObject *)Py_TYPE(owner) != self->classes[i]) return 0;
    PyObject *d = instance_dict(owner);
    if (d == NULL) {
        PyErr_Clear();
        return 0;
    }
    /* The same plain __dict__ at the same tag still maps the three names to the same dicts (a tag is
     * drawn from a global counter when a dict is made or written: no other dict can show it). */
    int same_owner = self->versions && PyDict_CheckExact(d) && (void *)d == self->owner_dicts[i] &&
                     dict_version(d) == self->owner_versions[i];
    int unchanged = 1;
    for (int kind = 0; unchanged && kind < KINDS; kind++) {
        Py_ssize_t k = i * KINDS + kind;
        PyObject *sub = self->dicts[k];
        if (!same_owner) {
            PyObject *now = kind_dict(d, kind);
            if (now == NULL) PyErr_Clear();
            Py_XDECREF(now); /* compared by address only: the snapshot holds the dict it may be */
            if (now != sub) {
                unchanged = 0;
                break;
            }
        }
        if (self->versions && !self->ordered[k] && dict_version(sub) == self->dict_versions[k]) continue;
        unchanged = entries_equal(self, k);
        if (unchanged && self->versions) self->dict_versions[k] = dict_version(sub);
    }
    if (unchanged && self->versions && PyDict_CheckExact(d)) { /* remembered once all three agree */
        self->owner_dicts[i] = d;
        self->owner_versions[i] = dict_version(d);
    }
    Py_DECREF(d);
    return unchanged;
}

static PyObject *snapshot_unchanged(Snapshot *self, PyObject *model) {
    for (Py_ssize_t i = 0; i < self->owners; i++) {
        int unchanged = owner_unchanged(self, owner_at(self, model, i), i);
        if (unchanged < 0) return NULL;
        if (!unchanged) Py_RETURN_FALSE;
    }
    Py_RETURN_TRUE;
}

static PyObject *snapshot_get_versions(Snapshot *self, void *closure) {
    return PyBool_FromLong(self->versions);
}

static PyObject *snapshot_get_modules(Snapshot *self, void *closure) {
    Py_INCREF(self->modules);
    return self->modules;
}

static PyMethodDef snapshot_methods[] = {
    {"unchanged", (PyCFunction)snapshot_unchanged, METH_O, "unchanged(model): whether model's module tree is exactly what was snapshotted."},
    {NULL},
};

static PyGetSetDef snapshot_getset[] = {
    {"versions", (getter)snapshot_get_versions, NULL, "Whether unchanged dicts are recognised by their version tag.", NULL},
    {"modules", (getter)snapshot_get_modules, NULL, "Every module but the root, in walk order (a tuple).", NULL},
    {NULL},
};

static PyTypeObject SnapshotType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "torchlens_accel._index.Snapshot",
    .tp_doc = "Snapshot(model, modules, versions=True): a model's module tree as its index saw it; "
              "unchanged(model) checks it.",
    .tp_basicsize = sizeof(Snapshot),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_new = snapshot_new,
    .tp_dealloc = (destructor)snapshot_dealloc,
    .tp_traverse = (traverseproc)snapshot_traverse,
    .tp_clear = (inquiry)snapshot_clear,
    .tp_methods = snapshot_methods,
    .tp_getset = snapshot_getset,
};

static struct PyModuleDef index_module = {
    PyModuleDef_HEAD_INIT, "_index", "torchlens's model-structure check, compiled.", -1, NULL,
};

PyMODINIT_FUNC PyInit__index(void) {
    const char *names[KINDS] = {"_modules", "_parameters", "_buffers"};
    for (int kind = 0; kind < KINDS; kind++)
        if ((kind_names[kind] = PyUnicode_InternFromString(names[kind])) == NULL) return NULL;
    if (PyType_Ready(&SnapshotType) < 0) return NULL;
    PyObject *m = PyModule_Create(&index_module);
    if (m == NULL) return NULL;
    if (PyModule_AddIntConstant(m, "ABI", TORCHLENS_ACCEL_ABI) < 0 ||
        PyModule_AddIntConstant(m, "HAVE_DICT_VERSIONS", HAVE_DICT_VERSIONS) < 0 ||
        PyModule_AddObjectRef(m, "Snapshot", (PyObject *)&SnapshotType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
