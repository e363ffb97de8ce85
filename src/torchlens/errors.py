"""Every error torchlens raises on purpose, in one place; each message says what went wrong and what to do.

Nothing here imports the rest of torchlens, so every layer can raise these.  The modules that raise an
error also re-export it under its former home (``torchlens.io.format.TraceFileError`` and so on).
``add_note`` is the one way torchlens notes an exception it passes on (the model's own); ``warn_user`` is the
one way torchlens warns: at the user's line, not at a line of torchlens; ``first_few`` lists names in a
message, and ``closest_hint`` suggests the known names nearest a misspelt one.
"""

import difflib
import os
import sys
import warnings

_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep


def warn_user(message: str, category=UserWarning) -> None:
    """``warnings.warn``, attributed to the first frame outside torchlens (the user's call into it), so
    the warning names the user's file and line however deep in torchlens it was raised."""
    frame, level = sys._getframe(1), 2  # level 2: warn_user's caller
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)


def add_note(exc: BaseException, note: str) -> None:
    """``exc.add_note(note)``, unless the exception refuses notes (a frozen dataclass exception, one whose
    ``__notes__`` is not a list): the exception a model raised must reach the caller as it was raised, and a
    note is only a hint, so it is left off rather than replace that exception with the failure to add it."""
    try:
        exc.add_note(note)
    except Exception:  # noqa: BLE001 - any failure to note: the model's exception goes on unnoted
        pass


def first_few(names, n: int = 3) -> str:
    """``names`` for a message: the first ``n``, and how many more."""
    names = list(names)
    return ", ".join(names[:n]) + (f" and {len(names) - n} more" if len(names) > n else "")


def counted(n: int, noun: str, plural: str = "") -> str:
    """``n`` and ``noun`` for a message, the noun plural unless ``n`` is 1: "1 op", "3 ops"."""
    return f"{n} {noun}" if n == 1 else f"{n} {plural or noun + 's'}"


def listed(names, n: int, more: str = " ...") -> str:
    """The first ``n`` of ``names`` for a message, ``more`` marking that some were left out."""
    names = list(names)
    return ", ".join(names[:n]) + (more if len(names) > n else "")


def closest_hint(name: str, known) -> str:
    """``"; closest: a, b"`` naming up to five of ``known`` that resemble ``name`` (empty when none do): the
    tail of every "no such label" message, so a typo is answered with what was meant.  The names ``name`` is
    the end of come first: a module address written from inside the model (``layers.1`` for
    ``model.layers.1``, as the module's own code or another library's names call it) is no typo, and too
    short beside the full address for a spelling match to find it.  Then those equal to it but for case
    (``LINEAR_1_1``, ``Relu``), which differ in too many letters for a spelling match."""
    known = list(known)
    ends = sorted((k for k in known if k.endswith("." + name)), key=len)
    cased = [k for k in known if k.lower() == name.lower()]
    close = list(dict.fromkeys(ends + cased + difflib.get_close_matches(name, known, n=5, cutoff=0.5)))[:5]
    return f"; closest: {', '.join(close)}" if close else ""


# The reference library's options, as its users type them into tl.trace (or log_forward_pass): what torchlens
# takes instead.  A spelling match answers them wrongly (layers_to_save is closest to stop_after, not save).
REFERENCE_OPTIONS = {
    "layers_to_save": "give save= the same selection",
    "save_gradients": "give grads=True, or grads= the layers whose gradients to keep",
    "vis_opt": "call log.render('graph.html', view='rolled' or 'unrolled') on the returned trace",
    "vis_outpath": "call log.render(path) on the returned trace",
    "output_device": "pass save_device= to tl.trace",
    "random_seed": "seed torch yourself before tracing (torchlens never touches the RNG)",
    "keep_unsaved_layers": "every op's metadata is always kept; save= chooses activations",
    "activation_postfunc": "transform log[label].activation after the trace",
    "detach_saved_tensors": "saved activations are always detached",
}


def unknown_option_hint(who: str, name: str, known) -> str:
    """The tail of an entry point's refusal of a keyword ``name`` it does not take: the torchlens way for a
    reference-library option, else the closest of the ``known`` options and where a forward's keyword goes."""
    if name in REFERENCE_OPTIONS:
        return f"; {name}= is a reference-library option torchlens does not take: {REFERENCE_OPTIONS[name]}"
    return closest_hint(name, known) + forward_keyword_hint(who, name)


def refuse_unknown_keywords(who: str, kwargs: dict, func, given: int = 2, also: tuple = (),
                            takes: str = "{}") -> None:
    """Refuse, in ``who``'s name and with the closest option, a keyword that ``func`` (which ``who`` passes its
    keywords on to) does not take: Python's refusal names ``func`` alone, with no hint (``log.save(p,
    activation=False)``: "save() got an unexpected keyword argument 'activation'").  ``given``: how many of
    ``func``'s leading parameters ``who`` fills itself (a method's record and path; a helper's ``self``);
    ``also``: options ``who`` takes besides ``func``'s, which ``takes`` then names; ``takes``: how the message lists
    the options, ``{}`` standing for ``func``'s."""
    if not kwargs:
        return
    import inspect

    parameters = list(inspect.signature(func).parameters.values())[given:]
    named = [p.name for p in parameters if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    options = named + list(also)
    for name in kwargs:
        if name not in options:
            raise TypeError(f"{who}() got an unexpected keyword argument {name!r}; it takes "
                            f"{takes.format(', '.join(named))}{closest_hint(name, options)}")


def refusing_unknown_keywords(who: str):
    """Decorate a public function so that a keyword it does not take is refused by ``refuse_unknown_keywords``,
    naming ``who``, what it takes and the closest, rather than by Python with no hint."""
    import functools

    def decorate(func):
        @functools.wraps(func)
        def checked(*args, **kwargs):
            refuse_unknown_keywords(who, kwargs, func, given=0)
            return func(*args, **kwargs)
        return checked
    return decorate


def forward_keyword_hint(who: str, name: str) -> str:
    """The tail of an entry point's refusal of a keyword it does not take: the commonest such keyword is one of
    the forward's own (``attention_mask=``, ``max_new_tokens=``), which goes in ``kwargs``."""
    return (f"; if {name!r} is a keyword argument of the forward, give it in kwargs: "
            f"{who}(model, args, {{{name!r}: ...}})")


class TorchlensError(Exception):
    """Base class for torchlens's own errors."""


class MissingPackage(TorchlensError, ImportError):
    """An optional package the call needs is not installed; the message names it and how to install it."""


# ----- the record ---------------------------------------------------------------------------------
class ActivationUnavailable(TorchlensError):
    """An activation was asked for that the trace does not hold: cleaned up, dropped (written or freed since it was
    saved), or left out of a saved trace (``activations=False``, a layout no file format encodes)."""


class TraceCleanedUp(TorchlensError):
    """Data released by ``Trace.cleanup()`` was asked for."""


# ----- capture ------------------------------------------------------------------------------------
class NestedTraceError(TorchlensError):
    """``tl.trace`` was called from inside a traced forward."""


class UnmatchedSelection(TorchlensError, KeyError):
    """A ``save=`` or ``grads=`` entry, or a ``layers=`` entry of ``tl.extract``, named nothing in the trace (a
    ``KeyError`` naming the closest labels)."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class AmbiguousKey(TorchlensError, KeyError):
    """A key names two different things in a trace (a module named like a label: ``linear_1_1``)."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


# ----- gradients and interventions ----------------------------------------------------------------
class GradientUnavailable(TorchlensError):
    """A gradient was asked for that autograd never computes or the trace was not set up to receive."""


class InterventionError(TorchlensError):
    """An intervention could not be applied faithfully (its site was not reached, the forward took
    another path than the reference trace, or an action returned an unusable value)."""


class ReplacementMismatch(InterventionError, ValueError):
    """A helper's new value does not fit its site (another shape), or its source trace did not save one.  A
    ValueError, and an InterventionError so that patching tables report it in the site's row."""


# ----- files (torchlens.io) -----------------------------------------------------------------------
class TraceFileError(TorchlensError, ValueError):
    """A saved trace or extraction folder is missing, damaged, tampered with, or from another schema."""


class UnsafeMemberError(TraceFileError):
    """A file in a torchlens folder is not a plain, bounded, in-folder regular file (a link, FIFO, device,
    directory, or oversized), so it is refused before anything reads it."""


class ResumeMismatchError(TorchlensError, ValueError):
    """``tl.extract`` was asked to resume a folder written with another model, other arguments or other inputs."""


class RankFailedError(TorchlensError, RuntimeError):
    """A rank did not reach a distributed barrier in time: it died, hung, or raised."""


# ----- reports and pictures -----------------------------------------------------------------------
class ProfilerBusyError(TorchlensError, RuntimeError):
    """A torch profiler is already running, and it was not handed to ``kernel_profile``."""


class WitnessFailed(TorchlensError):
    """The traced and the FlopCounterMode executions could not be shown to run the same program."""


class NativeToolFailed(TorchlensError, RuntimeError):
    """A PyTorch tool torchlens hands a measurement to failed on this model, for a reason of its own."""


class LayoutEngineMissing(TorchlensError, RuntimeError):
    """Neither Graphviz's ``dot`` nor the ``graphviz-pure`` executable could be found."""


class LayoutFailed(TorchlensError, RuntimeError):
    """The layout engine ran and reported an error."""
