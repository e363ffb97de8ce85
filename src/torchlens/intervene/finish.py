"""After an intervened forward: what was applied is attached to the trace, and a run that did not do what
its sites asked is refused rather than returned.  A site never reached, a layer label or predicate whose run
ended before some of the ops it names, or ran past the reference the sites were resolved against (a
``generate()`` that decodes more or fewer steps once an edit changed a token), are errors; a stopped trace
takes the labels of the whole forward and names the sites past its stop."""

from __future__ import annotations

from ..errors import InterventionError, first_few, listed, warn_user
from ..record.columns import Kind
from ..record.lookup import numbered_past_note, refuse_ambiguous
from ..record.op import Layer
from ..record.params import bypassed_call_hint
from .runtime import Interventions
from ..labels.naming import LABEL
from .sites import ModuleSite


def finish_interventions(runtime: Interventions, trace) -> None:
    """Attach what was applied to the finished trace; a site the forward never reached is an error."""
    runtime.attach(trace)
    _warn_calls_on_other_threads(runtime, trace)
    module_of = None  # address -> the Module record it names, made once for every numbered module site
    for site in runtime.module_sites:
        if LABEL.match(site.key):  # a module named like a label: refused where the label names other ops
            refuse_ambiguous(trace, site.key, "intervention site ")
        if site.call_number is not None:
            module_of = _modules_by_address(trace) if module_of is None else module_of
            _refuse_a_call_of_a_second_name(site, module_of)
    if runtime.stopped_at is not None:
        trace.stopped_after = runtime.stopped_at
        if runtime.reference is not None:
            _labels_from(runtime.reference, trace)
        _warn_past_the_stop(runtime)
        return
    unmet = runtime.unmet()
    _refuse_a_run_that_ended_before_some_ops(runtime)
    if unmet:
        edits = [site for site in unmet if not site.stop]  # a stop_after= site alone changes nothing
        named = edits or unmet
        ran = _ran(trace, named)
        done = f"{', '.join(r for r in ran if r)}, but returned no output to change: {_NO_OUTPUT}" if any(ran) else ""
        never = done if all(ran) else _not_run(runtime, trace, named, ran) + (f" ({done})" if done else "")
        if not edits:
            raise InterventionError(f"stop_after site {_site_names(named)} was never reached: {never}, and the "
                                    "forward ran to its end; name a site it reaches (print(tl.trace(model, x)) lists "
                                    "its ops and module calls)")
        raise InterventionError(f"intervention site(s) {_site_names(named)} were never reached: {never}; nothing "
                                f"was changed there.{runtime._written_note()}")
    _refuse_ops_past_the_reference(runtime, trace)


_NO_OUTPUT = ("it returned None or no tensor, or raised an exception, in its forward or one of its hooks, that the "
              "model caught")


def _ran(trace, sites: list) -> list:
    """For each site, how it ran though it was never reached: a module site whose calls returned nothing to change
    (a count, None) is "module 'x' was called (x:1)" or "x:1 ran"; None for a site that did not run."""
    module_of, made, ran = _modules_by_address(trace), {call.label for call in trace.module_calls}, []
    for site in sites:
        module = module_of.get(site.address) if isinstance(site, ModuleSite) else None
        if module is None or not module.num_calls:
            ran.append(None)
        elif site.call_number is None:
            ran.append(f"module {site.address!r} was called ({first_few(module.call_labels)})")
        else:
            key = f"{site.address}:{site.call_number}"
            ran.append(f"{key} ran" if key in made else None)
    return ran


def _not_run(runtime: Interventions, trace, sites: list, ran: list) -> str:
    """Why the sites that did not run (``ran``'s None) were never reached.  A module site run on another thread only
    (a thread pool's worker) is said to be that, rather than read as control flow that skipped it."""
    away = [site for site, how in zip(sites, ran) if how is None and isinstance(site, ModuleSite)
            and id(site.module) in runtime.called_elsewhere]
    elsewhere = (f"{_site_names(away)} ran on another thread only, where a trace neither records nor edits a call: "
                 "make those calls on the thread that calls tl.trace") if away else ""
    if len(away) == ran.count(None):
        return elsewhere
    whole = [site.address for site in sites if isinstance(site, ModuleSite) and site.call_number is None]
    numbered = [site for site in sites if isinstance(site, ModuleSite) and site.call_number is not None]
    return (f"the forward ran no such op or module call (a module call number past its last call, or control flow "
            f"that skipped it){_bypassed_hint(trace, whole)}{_calls_made_hint(trace, numbered)}"
            + (f"; {elsewhere}" if elsewhere else ""))


def _bypassed_hint(trace, addresses: list) -> str:
    """For a module site (an address alone) never reached: ``bypassed_call_hint``, for a forward called directly."""
    return next((hint for hint in (bypassed_call_hint(trace, a) for a in addresses) if hint), "")


def _calls_made_hint(trace, sites: list) -> str:
    """The calls the module of a numbered module site past its last call made (``fc:4`` of a module run three
    times), as a lookup of that key in the trace says them: the numbers there are, rather than a look-up left to do."""
    notes = (numbered_past_note(trace, f"{site.address}:{site.call_number}") for site in sites)
    return next((note for note in notes if note), "")


def _modules_by_address(trace) -> dict:
    """Every address of every module record -> that record (the first to have it), found in one pass rather than
    one search of the modules per site: a site per call of n modules would be n * n reads."""
    module_of: dict = {}
    for module in trace.modules:
        for address in module.all_addresses:
            module_of.setdefault(address, module)
    return module_of


def _refuse_a_call_of_a_second_name(site, module_of: dict) -> None:
    """``layers.3:1`` where ``layers.3`` is a second name of a module called several times (``nn.ModuleList([block]
    * 4)``): calls are numbered per module object, so the number counted every call, through whichever name it
    was made; which of them the name meant is unknowable.  (A second name under another parent is refused
    before the run: intervene/sites.py.)"""
    module = module_of.get(site.address)
    if module is None or module.address == site.address or module.num_calls < 2:
        return
    raise InterventionError(
        f"intervention site {site.key!r}: {site.address} is another name of the module {module.address}, which ran "
        f"{module.num_calls} times; its calls are numbered per module object, whichever name made them, and labelled "
        f"{listed(module.call_labels, 4, ', ...')}: name the call by one of "
        f"those labels, or give the address {site.address!r} alone to change every call")


def _refuse_a_run_that_ended_before_some_ops(runtime: Interventions) -> None:
    """A layer label or a predicate applied to some of its ops and not to later ones: every position up to
    the end of the run was checked on the way, so the run ended before those (``generate()`` stopping sooner
    once the edit changed a token).  Said so, rather than that the site was never reached."""
    hit_keys = {id(site.key) for site in runtime.label_sites if id(site) in runtime.hit}
    partly = [site for site in runtime.label_sites if id(site) not in runtime.hit and id(site.key) in hit_keys]
    if partly:
        raise InterventionError(
            f"intervention site(s) {_site_names(partly)} changed some of the ops they name, but the forward ended "
            f"before {first_few(site.op.label for site in partly)}, which the reference run the sites were resolved "
            f"against made (a generate() that stopped sooner once the edit changed a token).{runtime._written_note()} "
            "A module site (a module's address) is matched while the model runs and changes every call of it")


def _refuse_ops_past_the_reference(runtime: Interventions, trace) -> None:
    """A layer label or a predicate stands for every op it names, but was resolved against the reference run.
    A forward that ran longer than the reference (a loop that ran more times, ``generate()`` decoding more steps
    once an edit changed a token) made ops where no site was positioned: those the key names were not edited,
    which the trace must not pass off as an edit of every pass.  Such ops come past the reference's last call, or
    before it when the longer loop is followed by ops the sites do not name.  Only a longer run is looked at."""
    reference = runtime.reference
    # The raw count: ``trace.calls`` would name every call of the trace to count them.
    if reference is None or len(trace._calls) <= len(reference.calls):
        return
    sites = {id(site.key): site for site in runtime.label_sites if not site.stop}
    edited = _records_edited(runtime)
    missed = {key: [op.label for op in _ops_named(trace, site.key) if op.index not in edited.get(key, ())]
              for key, site in sites.items()}
    if any(missed.values()):
        names = _site_names(site for key, site in sites.items() if missed[key])
        stopped = getattr(reference, "stopped_after", None)
        if stopped:
            raise InterventionError(
                f"intervention site(s) {names} also name {first_few(sum(missed.values(), []))}, made after the last "
                f"call of the reference trace the sites were resolved against, which stopped after {stopped} "
                "(stop_after=) and so names no op after it: pass reference= a trace of the whole forward, or none")
        raise InterventionError(
            f"intervention site(s) {names} also name {first_few(sum(missed.values(), []))}, which the reference run "
            f"the sites were resolved against did not make: this forward ran longer (a loop that ran more times, a "
            f"generate() that decoded more steps once the edit changed a token), so those ops were not edited."
            f"{runtime._written_note()} A module site (a module's address) is matched while the model runs and "
            "changes every call of it")


def _records_edited(runtime: Interventions) -> dict:
    """``id(key) -> records`` each site key's action ran at (a probe's too), from what the run applied."""
    edited: dict = {}
    for record, applied in runtime.applied.items():
        for key in applied.site if isinstance(applied.site, tuple) else (applied.site,):
            edited.setdefault(id(key), set()).add(record)
    return edited


def _ops_named(trace, key) -> list:
    """The ops of ``trace`` a layer label or a predicate names (none for an op label: it names one op)."""
    if callable(key):
        return [op for op in trace.ops if trace.kinds[op.index] == Kind.OP and key(op)]
    try:
        found = trace[key]
    except KeyError:
        return []
    return found.ops if isinstance(found, Layer) else []


def _warn_calls_on_other_threads(runtime: Interventions, trace) -> None:
    """A site module the forward also ran on another thread (or that another thread ran meanwhile): capture records
    and edits the tracing thread's calls only, so those calls ran as untraced, which a forward hook of the user's
    would have edited.  Said, rather than leaving an output unlike the hand-made edit unexplained.  What they
    returned reached this trace only if its forward read it (a thread it started): then as tensors of unknown
    origin; a thread running the model on its own (its own trace, or none) hands this trace nothing."""
    elsewhere = [site for site in runtime.module_sites if id(site.module) in runtime.called_elsewhere]
    if elsewhere:
        read = (", and what they returned, read by this forward, enters the trace as tensors of unknown origin "
                "(Trace.unattributed)") if trace.unattributed else ""
        warn_user(f"module site(s) {_site_names(elsewhere)} also ran on another thread while the trace ran: a trace "
                  f"records and edits the calls of its own thread only, so those calls ran unedited{read}; make "
                  "those calls on the thread that calls tl.trace to edit them")


def _site_names(sites) -> str:
    return ", ".join(dict.fromkeys(repr(s.key) if isinstance(s.key, str) else "<predicate>" for s in sites))


def _warn_past_the_stop(runtime: Interventions) -> None:
    """A stopped forward never reaches the sites after its stop: those that changed nothing at all are
    named (a predicate that edited some ops before the stop did its part), rather than dropped silently."""
    hit_keys = {id(s.key) for s in (*runtime.label_sites, *runtime.module_sites) if id(s) in runtime.hit}
    unmet = [s for s in runtime.unmet() if s is not runtime.stop_site and id(s.key) not in hit_keys]
    if unmet:
        warn_user(f"intervention site(s) {_site_names(unmet)} come after {runtime.stopped_at}, where the forward "
                  "stopped (stop_after=): they changed nothing (trace.interventions lists what was applied)")


def _labels_from(reference, trace) -> None:
    """Give a stopped trace the labels its ops have in the whole forward (``reference``), which labels
    derived from the ops before the stop can differ from (pass counts, layers a later call would join).
    Done only when the stopped trace is, op for op, a prefix of the reference."""
    n = len(trace.kinds)
    if n > len(reference.kinds) or trace.kinds != reference.kinds[:n] or trace.func_names != reference.func_names[:n]:
        return
    trace.relabel(reference.labels[:n], reference.op_layer_labels[:n], reference.pass_numbers[:n],
                  reference.groups[:n])
    for record, applied in trace._interventions.items():
        applied.label = trace.labels[record]
