"""The check, at each label site, that the forward reached the op the reference made at that position.

Every site call asks it, so it is kept to lookups: a function's name is derived once per function
(``names``), the call's line once per call, and the module calls open around the op are compared with the
reference's once per innermost module call (``chains_met``); the messages of a refusal are built only
when it refuses.
"""

from __future__ import annotations

from ..errors import InterventionError
from ..record.columns import CALL_CODE, CALL_FUNC, CALL_LINE, MODULE_CALL_MODULE
from ..record.modules import is_unregistered, shown_class
from ..record.source import source_of
from .sites import call_line, deep_mismatch_note, named_once, occurrence_key, site_kind


class ReferencePath:
    """What ``Interventions`` checks a label site's call against: the reference's function, module calls, line
    and occurrence.  Its state: ``addresses`` (id(module) -> addresses) and ``reference``, set by the runtime."""

    addresses: dict
    reference = None
    reference_made = False  # the reference is the pass of these inputs made first (``_state_note``)
    deep = False  # the intervened trace's deep=, against the reference's (``_deep_note``)

    def _start_path(self) -> None:
        self.names: dict = {}  # function -> func_name_of(function), derived once per trace
        # innermost open module call -> the reference chain found open around it: the calls open around a
        # module call are fixed while it runs, so a later site in it with that chain needs no second walk.
        self.chains_met: dict = {}
        self.seen_keys: dict = {}  # occurrence_key -> calls of this run with it, before position ``counted``
        self.counted, self.last_counted = 0, (-1, 0)  # and the last call counted: (its position, occurrence)

    def _check_path(self, st, sites, call_position, func) -> None:
        name = named_once(self.names, func)
        call = st.calls[call_position]
        code, line = call[CALL_CODE], call_line(call)
        occurrence = self._occurrence(st, call_position, name, line)
        innermost = st.module_stack[-1] if st.module_stack else -1
        for site in sites:
            if name != site.func_name or not site.same_line(code, line) or not self._chain_met(st, innermost, site):
                place = source_of(code, call[CALL_LINE])
                where = " > ".join(self._address(st.module_calls[k][MODULE_CALL_MODULE]) for k in st.module_stack) \
                    or "the root forward"
                expected = " > ".join(link.address for link in site.chain) or "the root forward"
                self._refuse_replaced(st, site)
                self._diverged(site, f"called {name!r} in {where}{_at(place)}, where the reference called "
                                     f"{site.func_name!r} in {expected}{_at(site.place)}")
            if site.occurrence is not None and occurrence != site.occurrence:
                place = source_of(code, call[CALL_LINE])
                self._diverged(site, f"made call {occurrence + 1} of {name!r} from that line{_at(place)} in its "
                                     f"module call, where the reference made call {site.occurrence + 1}")

    def _chain_met(self, st, innermost: int, site) -> bool:
        """``_same_chain`` for the site's chain, asked once per innermost module call and chain."""
        if self.chains_met.get(innermost) is site.chain and len(st.module_stack) == len(site.chain):
            return True
        if not self._same_chain(st, site.chain):
            return False
        self.chains_met[innermost] = site.chain
        return True

    def _refuse_replaced(self, st, site) -> None:
        """Refuse, saying so, a site whose open module calls are the reference's by address but not by object:
        modules replaced since the reference was traced (``model.fc = nn.Linear(...)``), which an account of
        the two paths would describe alike."""
        if len(st.module_stack) != len(site.chain):
            return
        replaced = [link.address for k, link in zip(st.module_stack, site.chain)
                    if link.module is not None and st.module_calls[k][MODULE_CALL_MODULE] is not link.module
                    and self._address(st.module_calls[k][MODULE_CALL_MODULE]) == link.address]
        if replaced:
            raise InterventionError(
                f"{site_kind(site.stop)} {site_where(site.key, site.op)}: module {', '.join(replaced)} is another "
                "object than the one the reference trace ran (replaced since the reference was traced?), so the "
                "reference does not describe this model; pass reference= a trace of the model as it is now, or none "
                "(a reference pass is then made first)")

    def _diverged(self, site, what: str):
        """Refuse a label site whose position holds another op in this run than in the reference."""
        raise InterventionError(
            f"{site_kind(site.stop)} {site_where(site.key, site.op)}: the forward took another path than the "
            f"reference trace: at that position it {what}.{self._written_note() or self._state_note()}"
            f"{self._deep_note()} Pass reference= a trace of inputs that take the same path, or use a module site")

    def _occurrence(self, st, call_position: int, name: str, line) -> int:
        """How many calls with the ``occurrence_key`` of the call at ``call_position`` (``name`` made at ``line``)
        this run made before it, counted up to each site only when the forward reaches it (the ops between sites
        cost nothing), and each call once: the site's own is counted here (a stop site at that call asks
        again, ``last_counted``)."""
        if call_position != self.last_counted[0]:
            seen, calls = self.seen_keys, st.calls
            for position in range(self.counted, call_position):
                call = calls[position]
                key = occurrence_key(call, named_once(self.names, call[CALL_FUNC]), call_line(call))
                seen[key] = seen.get(key, 0) + 1
            key = occurrence_key(calls[call_position], name, line)
            self.last_counted = (call_position, seen.get(key, 0))
            if call_position >= self.counted:
                seen[key], self.counted = self.last_counted[1] + 1, call_position + 1
        return self.last_counted[1]

    def _deep_note(self) -> str:
        note = deep_mismatch_note(self.reference, self.deep)
        return f" {note}." if note else ""

    def _written_note(self) -> str:
        """Why a reference of the same inputs can still take another path: its forward wrote parameters."""
        replay = self.reference._replay if self.reference is not None else None  # (none: module sites only)
        if replay is None or not replay.param_writes:
            return ""
        return (" The reference's forward wrote parameters in place (a one-time rescale, an update), so the model "
                "has changed since it ran.")

    def _state_note(self) -> str:
        """Why a reference made of these same inputs, with the model put back after it, can take another path."""
        if not self.reference_made:
            return ""
        return (" The reference was a pass of these same inputs, made first, and the model was put back after it: "
                "a callable keeping state of its own between calls (a cache object it holds, a counter) runs "
                "differently each time; give it fresh state per call.")

    def _same_chain(self, st, expected) -> bool:
        """Whether the module calls open now are the reference's, call for call."""
        stack = st.module_stack
        if len(stack) != len(expected):
            return False
        for k, link in zip(stack, expected):
            module = st.module_calls[k][MODULE_CALL_MODULE]
            if k != link.call:
                return False
            if module is link.module:
                continue
            if is_unregistered(link.address):
                # A module outside the model may be made anew by each forward (T5's loss): at the same call,
                # an unregistered module of the same class is the same site.
                if id(module) in self.addresses or shown_class(module).__name__ != link.class_name:
                    return False
            elif link.module is not None or self._address(module) != link.address:
                return False
        return True

    def _address(self, module) -> str:
        names = self.addresses.get(id(module))
        return names[0] if names else type(module).__name__


def _at(place) -> str:
    """`` (file:line)`` of a recorded call, or nothing when no user frame was found."""
    return f" ({place.file}:{place.line})" if place is not None else ""


def site_where(key, op) -> str:
    """A site for a message: its key (``<predicate>`` for a function), and the op or module call it resolved
    to when that says more."""
    name = repr(key) if isinstance(key, str) else "<predicate>"
    return name if key == op.label else f"{name} ({op.label})"

