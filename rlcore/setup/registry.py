"""The plugins of one process: found by ``importlib.metadata``, registered with pluggy.

:func:`load_registry` builds a :class:`Registry`: a pluggy ``PluginManager`` with the
hooks of :mod:`rlcore.hookspecs`, the core's own plugin (:mod:`rlcore.setup.builtin`),
every entry point of group ``rlcore.backends`` the allowlist lets through, then plugins
given in-process. pluggy validates each ``@hookimpl`` against its spec and calls the
hooks; rlcore adds what pluggy leaves to its users: an unknown ``rlcore_*`` hook named
with the closest real one, a backend's declaration checked (valid, a contract version
this core implements, a backend name nobody else has), and a plugin that declares no
backend kept from implementing an init hook plainly (it would run whatever backend the
config selects). A plugin that fails is unregistered and recorded as a
:class:`PluginFailure` (one line naming it, its distribution and the fix); every other
plugin keeps working, and nothing here raises for a bad plugin.

Loading is idempotent and cheap, because Ray workers load the plugins again: a plugin
module imports its heavy dependencies inside its hooks.
"""

from __future__ import annotations

import difflib
import importlib.metadata
import inspect
import logging
import os
import sys
import threading
import traceback
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import pluggy

from rlcore import hookspecs
from rlcore.declarations import (
    CONTRACT_VERSION,
    BackendDeclaration,
    Role,
    contract_compatible,
    porting_note,
    validate_declaration,
)
from rlcore.errors import BackendNotFoundError, DeclarationError
from rlcore.setup import builtin
from rlcore.setup.installed import (
    InstalledCopy,
    dist_location,
    hidden_entry_points,
    installed_twice,
    normalized_name,
    refuse_copies,
)

logger = logging.getLogger(__name__)

#: Entry-point group under which plugin distributions register their plugin module.
ENTRY_POINT_GROUP = "rlcore.backends"
#: Environment variable: comma-separated entry-point names; only those plugins load.
ALLOWLIST_ENV = "RLCORE_PLUGINS"
#: Failure stages, in the order a plugin goes through them.
STAGES = ("import", "validate", "declare", "contract", "duplicate")

#: The init hook of each role: a wrapper plugin may only wrap these.
_INIT_HOOKS = {role: f"rlcore_init_{role.value}" for role in (Role.POLICY, Role.GENERATION, Role.ENV)}
_ALLOW_HINT = f"plugins.allow in the config or ${ALLOWLIST_ENV}"


@dataclass(frozen=True)
class PluginInfo:
    """A plugin that registered successfully.

    Attributes:
        name: the entry-point name (or the name given to :meth:`Registry.register`).
        distribution: the distribution that provides it (``rlcore-fsdp``);
            ``None`` for plugins registered in-process.
        version: that distribution's version, if known.
        declaration: the backend it declares; ``None`` for a wrapper-only plugin
            (and for the core's built-in plugin).
        plugin: the registered module or object.
    """

    name: str
    distribution: str | None
    version: str | None
    declaration: BackendDeclaration | None
    plugin: object

    @property
    def is_backend(self) -> bool:
        return self.declaration is not None

    def origin(self) -> str:
        """``plugin 'name' (distribution dist version)``: how messages name a plugin."""
        return _origin(self.name, self.distribution, self.version)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready form (``rlcore plugins --json``)."""
        decl = self.declaration
        return {
            "name": self.name, "distribution": self.distribution, "version": self.version,
            "kind": "backend" if decl is not None else "wrapper",
            "declaration": decl.to_dict() if decl is not None else None,
        }


@dataclass(frozen=True)
class PluginFailure:
    """A plugin that was reported and skipped.

    Attributes:
        name: the entry-point (or registration) name.
        distribution: the distribution that provides it, if known.
        stage: where it failed: ``import`` (loading the entry point raised),
            ``validate`` (a hook implementation does not match the contract in
            :mod:`rlcore.hookspecs`), ``declare`` (``rlcore_declare_backend``
            raised or returned an invalid declaration), ``contract`` (it targets a
            contract version this rlcore does not implement) or ``duplicate`` (its
            plugin name belongs to a plugin loaded before it, another installed plugin
            declares the same backend name, or its distribution is installed more than
            once at different versions).
        message: one line: names the plugin and distribution, says what went wrong and
            what to do.
        backend: the backend name it declared, when it got that far.
        version: the version of the code Python imports for it, when known (for a
            distribution installed twice, the copy whose files are imported).
        copies: for ``duplicate`` refusals of installed plugins, every copy or plugin
            involved, in the order found.
    """

    name: str
    distribution: str | None
    stage: str
    message: str
    backend: str | None = None
    version: str | None = None
    copies: tuple[InstalledCopy, ...] = ()

    @property
    def plugins(self) -> tuple[str, ...]:
        """Every plugin (entry-point) name this failure refuses, in the order found."""
        return tuple(dict.fromkeys([*(c.plugin for c in self.copies), self.name]))

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready form (``rlcore plugins --json``)."""
        return {
            "name": self.name, "distribution": self.distribution, "version": self.version,
            "stage": self.stage, "message": self.message, "backend": self.backend,
            "plugins": list(self.plugins), "copies": [c.to_dict() for c in self.copies],
        }


def _origin(name: str, distribution: str | None, version: str | None = None) -> str:
    if distribution is None:
        return f"plugin '{name}' (distribution unknown: registered in-process)"
    return f"plugin '{name}' (distribution {distribution}{' ' + version if version else ''})"


def _closest(name: str, candidates: Iterable[str]) -> str | None:
    match = difflib.get_close_matches(name, sorted(candidates), n=1, cutoff=0.5)
    return match[0] if match else None


class _Refused(Exception):
    """A registration stage refused a plugin (turned into a :class:`PluginFailure`)."""

    def __init__(
        self, stage: str, message: str, backend: str | None = None, copies: tuple[InstalledCopy, ...] = ()
    ) -> None:
        super().__init__(message)
        self.stage, self.message, self.backend, self.copies = stage, message, backend, copies


class Registry:
    """The loaded plugins of one process.

    Attributes:
        pm: the pluggy plugin manager (project ``rlcore``, hooks from
            :mod:`rlcore.hookspecs`). Call hooks through :meth:`hook` so that only
            the selected backend runs.
        backends: backend plugins by declared backend name.
        wrappers: wrapper-only plugins, in registration order.
        failures: plugins that were reported and skipped.
        disabled: entry-point names not loaded because of the allowlist.
        core: the core's own plugins (:mod:`rlcore.setup.builtin`): neither backends
            nor wrappers, always called.

    Two installed plugins (entry points) that declare the same backend name both
    lose it: neither is registered and one ``duplicate`` failure names them all,
    since which one the user meant cannot be known. A plugin registered in-process
    (:meth:`register`) whose backend name is taken is skipped and the first one kept.
    """

    def __init__(self) -> None:
        self.pm = pluggy.PluginManager(hookspecs.PROJECT)
        self.pm.add_hookspecs(hookspecs)
        self.backends: dict[str, PluginInfo] = {}
        self.wrappers: list[PluginInfo] = []
        self.failures: list[PluginFailure] = []
        self.disabled: list[str] = []
        self.core: list[PluginInfo] = []
        callers = vars(self.pm.hook).items()
        self._hook_names = tuple(sorted(n for n, c in callers if isinstance(c, pluggy.HookCaller)))
        self._infos: dict[str, PluginInfo] = {}  # every registered plugin, by name
        self._disabled_reason: dict[str, str] = {}
        self._installed: dict[str, InstalledCopy] = {}  # entry-point name -> its installed copy
        self._clashed: dict[str, PluginFailure] = {}  # backend names several installed plugins declare

    def register(
        self, plugin: object, name: str, distribution: str | None = None, version: str | None = None
    ) -> PluginInfo | None:
        """Register, validate and classify one plugin.

        Returns its :class:`PluginInfo`, or ``None`` if it failed (the failure is
        appended to :attr:`failures`, logged as a warning, and the plugin is
        unregistered again). Registering an object that is already registered
        returns its existing info and changes nothing. Never raises.
        """
        if self.pm.is_registered(plugin):
            return self._infos.get(self.pm.get_name(plugin) or "")
        who = _origin(name, distribution, version)
        try:
            self._admit(plugin, name, who)
            declared = self._declared(plugin, who)
            decl = None if declared is None else self._accepted(declared, name, distribution, version)
        except _Refused as no:
            if self.pm.get_name(plugin) == name:
                self.pm.unregister(plugin, name=name)
            failure = PluginFailure(name, distribution, no.stage, no.message, no.backend, version, no.copies)
            self._fail(failure)
            return None
        info = self._infos[name] = PluginInfo(name, distribution, version, decl, plugin)
        if decl is None:
            self.wrappers.append(info)
        else:
            self.backends[decl.name] = info
            self._warn_role_hooks(info)
        logger.debug("registered %s", info.origin())
        return info

    def _admit(self, plugin: object, name: str, who: str) -> None:
        """Stages 'duplicate' (the plugin name) and 'validate': pluggy checks each
        implementation against its spec; rlcore names an unknown hook's closest real one,
        and a plugin that declares no backend may only wrap the init hooks."""
        if self.pm.has_plugin(name):
            other = self._infos[name].origin() if name in self._infos else f"plugin '{name}'"
            raise _Refused(
                "duplicate",
                f"{who}: the plugin name '{name}' is already taken by {other}, so this one was "
                f"skipped. Uninstall one of the two distributions, or load only one of them ({_ALLOW_HINT}).",
            )
        try:
            self.pm.register(plugin, name=name)
            self.pm.check_pending()  # an implementation of a hook rlcore does not define
        except pluggy.PluginValidationError as err:
            unknown = self._unknown_hooks(plugin)
            raise _Refused("validate", f"{who}: {unknown}" if unknown else (
                f"{who}: a hook implementation does not match rlcore's hook specification: "
                f"{'; '.join(str(err).splitlines())}. An implementation may take any subset "
                "of its spec's arguments and no others; see the docstrings in rlcore.hookspecs."
            )) from None
        except Exception as err:  # noqa: BLE001 - a plugin must never take the core down
            why = f"pluggy could not register it: {type(err).__name__}: {err}"
            raise _Refused("validate", f"{who}: {why}") from None
        for attr in dir(plugin):  # pluggy ignores a function named like a hook but not marked
            # Read without running properties or descriptors; only functions can be hooks.
            value = inspect.getattr_static(plugin, attr, None)
            if isinstance(value, staticmethod | classmethod):
                value = value.__func__
            if not attr.startswith(f"{hookspecs.PROJECT}_") or not inspect.isfunction(value):
                continue
            if self.pm.parse_hookimpl_opts(plugin, attr) is None:
                logger.warning(
                    "%s: function '%s' is not marked with @hookimpl (from rlcore.hookspecs) "
                    "and will never be called", who, attr,
                )

    def _unknown_hooks(self, plugin: object) -> str | None:
        """What pluggy's ``check_pending`` refused, with the closest real hook names."""
        unknown = sorted(
            c.name for c in self.pm.get_hookcallers(plugin) or []
            if c.spec is None and any(i.plugin is plugin and not i.optionalhook for i in c.get_hookimpls())
        )
        if not unknown:
            return None
        hints = {n: _closest(n, self._hook_names) for n in unknown}
        parts = [f"'{n}'" + (f" (did you mean '{h}'?)" if h else "") for n, h in hints.items()]
        return (
            f"implements {', '.join(parts)}, which rlcore does not define. "
            f"rlcore's hooks are: {', '.join(self._hook_names)} (see rlcore.hookspecs). "
            "Rename the function, or mark it @hookimpl(optionalhook=True) if that is intended."
        )

    def _plain_hooks(self, plugin: object) -> set[str]:
        """The hooks ``plugin`` implements plainly (not as a wrapper)."""
        return {
            c.name for c in self.pm.get_hookcallers(plugin) or []
            for i in c.get_hookimpls() if i.plugin is plugin and not (i.wrapper or i.hookwrapper)
        }

    def _declared(self, plugin: object, who: str) -> object | None:
        """Stage 'declare': what the plugin's ``rlcore_declare_backend`` returns (``None``:
        a wrapper plugin, which may not implement an init hook plainly)."""
        others = [p for p in self.pm.get_plugins() if p is not plugin]
        try:
            results = self.pm.subset_hook_caller("rlcore_declare_backend", remove_plugins=others)()
            if len(results) > 1:
                raise ValueError(
                    f"{len(results)} implementations returned a declaration; "
                    "a plugin provides exactly one backend"
                )
        except Exception as err:  # noqa: BLE001
            raise _Refused(
                "declare",
                f"{who}: rlcore_declare_backend failed: {type(err).__name__}: {err}. It must build and "
                "return a BackendDeclaration cheaply, without importing the backend's engine.",
            ) from None
        if results:
            return results[0]
        plain = [h for h in _INIT_HOOKS.values() if h in self._plain_hooks(plugin)]
        if plain:
            raise _Refused(
                "validate",
                f"{who}: implements {', '.join(plain)} but declares no backend. Return a "
                "BackendDeclaration from rlcore_declare_backend to make it a backend, or mark "
                "the implementation @hookimpl(wrapper=True) to make it a wrapper plugin.",
            )
        return None

    def _accepted(
        self, declared: object, name: str, distribution: str | None, version: str | None
    ) -> BackendDeclaration:
        """Stages 'declare' (a valid declaration), 'contract' (a contract version this
        core implements) and 'duplicate' (the backend name is free)."""
        who = _origin(name, distribution, version)
        try:
            decl = validate_declaration(declared, plugin=name, distribution=distribution)
        except DeclarationError as err:
            raise _Refused(
                "declare",
                f"{err}\nFix the declaration returned by rlcore_declare_backend "
                "(see rlcore.declarations.BackendDeclaration).",
                getattr(declared, "name", None),
            ) from None
        if not contract_compatible(decl.contract_version):
            from rlcore import __version__

            raise _Refused(
                "contract",
                f"{who} declares backend '{decl.name}' for rlcore contract "
                f"{decl.contract_version}, but this rlcore ({__version__}) implements contract "
                f"{CONTRACT_VERSION}: install a release of {distribution or 'the plugin'} built "
                f"for contract {CONTRACT_VERSION.split('.')[0]}.x, or an rlcore whose contract "
                "it targets." + porting_note(decl.contract_version),
                decl.name,
            )
        owner = self.backends.get(decl.name)
        both_installed = owner is not None and owner.name in self._installed and name in self._installed
        if decl.name in self._clashed or both_installed:
            raise self._clash(decl.name, self._copy_of(name, distribution, version))
        if owner is not None:
            raise _Refused(
                "duplicate",
                f"{who} declares backend '{decl.name}', which {owner.origin()} already provides; "
                f"this one was skipped and '{decl.name}' stays with plugin '{owner.name}'. Uninstall "
                f"one of the two distributions, or load only one of them ({_ALLOW_HINT}).",
                decl.name,
            )
        return decl

    def _clash(self, backend: str, claimant: InstalledCopy) -> _Refused:
        """Refuse ``backend`` for every installed plugin that declares it: the one
        registered under it is unregistered, an earlier clash record is replaced by one
        that names every claimant, and the refusal of ``claimant`` is returned (to raise)."""
        claimants: list[InstalledCopy] = []
        owner = self.backends.pop(backend, None)
        if owner is not None:
            self.pm.unregister(owner.plugin, name=owner.name)
            del self._infos[owner.name]
            claimants.append(self._copy_of(owner.name, owner.distribution, owner.version))
        earlier = self._clashed.pop(backend, None)
        if earlier is not None:
            self.failures.remove(earlier)
            claimants.extend(earlier.copies)
        claimants.append(claimant)
        dists = list(dict.fromkeys(c.distribution for c in claimants if c.distribution))
        if len(dists) > 1:
            fix = ", or ".join(f"pip uninstall {d}" for d in dists)
            fix = f"uninstall the distribution you do not want ({fix})"
        else:
            fix = f"ask the maintainers of {dists[0] if dists else 'the plugins'} to declare it once"
        named = " and ".join(f"plugin '{c.plugin}' (distribution {c.describe()})" for c in claimants)
        return _Refused(
            "duplicate",
            f"backend '{backend}' is declared by {named}, so none of them is used: rlcore does "
            f"not pick one silently. Fix: {fix}, or load only one of them ({_ALLOW_HINT}).",
            backend,
            tuple(claimants),
        )

    def _copy_of(self, name: str, distribution: str | None, version: str | None) -> InstalledCopy:
        """Where plugin ``name`` comes from (``location`` ``None``: registered in-process)."""
        found = self._installed.get(name)
        if found is not None and found.distribution == distribution:
            return found
        return InstalledCopy(name, distribution, version, None, True)

    def _register_core(self, plugin: object, name: str) -> None:
        """Register one of the core's own plugins; a failure here is a bug in rlcore."""
        from rlcore import __version__

        if not self.pm.is_registered(plugin):
            self.pm.register(plugin, name=name)
            self.core.append(info := PluginInfo(name, "rlcore", __version__, None, plugin))
            self._infos[name] = info

    def _fail(self, failure: PluginFailure) -> None:
        if failure not in self.failures:
            self.failures.append(failure)
            logger.warning("skipping plugin (%s): %s", failure.stage, failure.message)
        if failure.backend is not None and len({c.plugin for c in failure.copies}) > 1:
            self._clashed[failure.backend] = failure

    def _warn_role_hooks(self, info: PluginInfo) -> None:
        assert info.declaration is not None
        plain = self._plain_hooks(info.plugin)
        for role, hook_name in _INIT_HOOKS.items():
            if role in info.declaration.roles and hook_name not in plain:
                logger.warning(
                    "%s declares role '%s' but does not implement %s; selecting it for %s will fail",
                    info.origin(), role, hook_name, role,
                )

    def backend_for(self, role: Role | str, name: str | None) -> PluginInfo:
        """The backend called ``name`` that serves ``role``.

        Raises :class:`BackendNotFoundError` naming the config key
        (``<role>.backend``), the value, the backends that serve the role, the
        closest name, and why a plugin of that name is missing (failed to load,
        left out by the allowlist, or serves other roles).
        """
        role = Role(role)
        key = f"{role.value}.backend"
        serving = sorted(n for n, i in self.backends.items() if i.declaration and role in i.declaration.roles)
        choices = ", ".join(serving) if serving else "(none loaded)"
        if not name:
            raise BackendNotFoundError(
                f"config key '{key}' is not set; backends that serve {role}: {choices} "
                "(`rlcore plugins` lists them)"
            )
        info = self.backends.get(name)
        if info is not None and info.declaration is not None:
            if role in info.declaration.roles:
                return info
            served = ", ".join(sorted(r.value for r in info.declaration.roles))
            msg = (
                f"config key '{key}' is '{name}', but backend '{name}' of {info.origin()} "
                f"serves {served}, not {role}. Backends that serve {role}: {choices}."
            )
        else:
            hint = _closest(name, serving)
            msg = (
                f"config key '{key}' is '{name}', but no loaded plugin provides a backend of that "
                f"name.{f' Did you mean {hint!r}?' if hint else ''} Backends that serve {role}: {choices}."
            )
        for failure in self.failures:
            if name == failure.backend or name in failure.plugins:
                msg += f"\nA plugin of that name failed to load ({failure.stage}): {failure.message}"
        if name in self._disabled_reason:
            msg += f"\nPlugin '{name}' is installed but {self._disabled_reason[name]}."
        msg += "\nRun `rlcore plugins` to list installed backends and plugins that failed."
        raise BackendNotFoundError(msg)

    def hook(self, hook_name: str, selected: Iterable[PluginInfo]) -> pluggy.HookCaller:
        """A caller of ``hook_name`` that runs only the ``selected`` backends.

        Every other backend plugin is left out; wrapper plugins and the core's
        own plugins stay in, so wrappers (timing, fault injection) see the call::

            info = registry.backend_for(Role.POLICY, cfg.policy.backend)
            handle = registry.hook("rlcore_init_policy", [info])(ctx=ctx)
        """
        if hook_name not in self._hook_names:
            hooks = ", ".join(self._hook_names)
            raise ValueError(f"'{hook_name}' is not an rlcore hook; hooks: {hooks}")
        keep = {id(info.plugin) for info in selected}
        remove = [i.plugin for i in self.backends.values() if id(i.plugin) not in keep]
        return self.pm.subset_hook_caller(hook_name, remove_plugins=remove)

    def declarations(self) -> dict[str, BackendDeclaration]:
        """Every loaded backend's declaration, by backend name."""
        return {n: i.declaration for n, i in sorted(self.backends.items()) if i.declaration is not None}

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready summary: backends, wrappers, failures, disabled entry points."""
        return {
            "backends": [i.to_dict() for _, i in sorted(self.backends.items())],
            "wrappers": [i.to_dict() for i in self.wrappers],
            "failures": [f.to_dict() for f in self.failures],
            "disabled": list(self.disabled),
        }


def _env_allowlist() -> set[str] | None:
    names = {part.strip() for part in os.environ.get(ALLOWLIST_ENV, "").split(",") if part.strip()}
    return names or None


def allowlist(config_allow: Sequence[str] | None) -> set[str] | None:
    """The entry-point names allowed to load, or ``None`` for no restriction.

    ``config_allow`` is ``plugins.allow`` from the config (``None``: unset; an
    empty list allows nothing). ``$RLCORE_PLUGINS`` is a comma-separated list
    (unset, empty or only commas and spaces: unset). When both are given a
    plugin must be in both: each one only narrows the set.
    """
    allowed = None if config_allow is None else {str(n).strip() for n in config_allow if str(n).strip()}
    env = _env_allowlist()
    if env is not None:
        allowed = env if allowed is None else allowed & env
    return allowed


def _iter_entry_points() -> list[importlib.metadata.EntryPoint]:
    """Installed entry points of :data:`ENTRY_POINT_GROUP`, sorted by name then
    distribution, so every process (Ray workers load plugins again) resolves a name
    clash the same way."""
    return sorted(importlib.metadata.entry_points(group=ENTRY_POINT_GROUP), key=_entry_point_order)


def _entry_point_order(ep: Any) -> tuple[str, str]:
    return ep.name, _dist_of(ep)[0] or ""


def _dist_of(ep: Any) -> tuple[str | None, str | None]:
    """The name and version of the distribution of ``ep`` (unknown: ``None``)."""
    try:
        return ep.dist.name, ep.dist.version
    except Exception:  # noqa: BLE001 - no or broken metadata must not stop loading
        return None, None


def _why_disabled(name: str, config_allow: Sequence[str] | None) -> str:
    reasons = []
    if config_allow is not None and name not in config_allow:
        reasons.append(f"plugins.allow = {list(config_allow)}")
    env = _env_allowlist()
    if env is not None and name not in env:
        reasons.append(f"{ALLOWLIST_ENV}={os.environ.get(ALLOWLIST_ENV, '')!r}")
    return "not loaded because it is not in " + " nor in ".join(reasons)


def load_registry(
    allow: Sequence[str] | None = None, *, entry_points: bool = True, extra: Iterable[tuple[str, object]] = ()
) -> Registry:
    """Build the registry of this process.

    Registers the core's built-in plugin, then every installed entry point of
    group ``rlcore.backends`` that :func:`allowlist` lets through (``allow`` is
    ``plugins.allow`` from the config), then the ``extra`` ``(name, plugin)``
    pairs (in-process plugins, e.g. test wrappers; the allowlist does not apply
    to them). A plugin that fails to import or validate is recorded in
    ``failures`` and skipped; so is a plugin whose distribution is installed more
    than once at different versions (:mod:`rlcore.setup.installed`), and a backend
    name that several installed plugins declare. This function does not raise for a
    bad plugin.

    Args:
        allow: ``plugins.allow`` from the config; ``None``: no restriction.
        entry_points: scan installed entry points (``False``: only ``extra``).
        extra: plugins to register in-process, in order.
    """
    registry = Registry()
    registry._register_core(builtin, builtin.PLUGIN_NAME)
    if entry_points:
        _load_entry_points(registry, allow)
    for name, plugin in extra:
        registry.register(plugin, name)
    return registry


def _load_entry_points(registry: Registry, allow: Sequence[str] | None) -> None:
    """Load and register the installed entry points that the allowlist lets through."""
    allowed = allowlist(allow)
    twice = installed_twice(ENTRY_POINT_GROUP)
    found = _iter_entry_points()
    hidden = hidden_entry_points(found, twice, ENTRY_POINT_GROUP)
    if hidden:
        found = sorted([*found, *hidden], key=_entry_point_order)
    if allowed is not None:
        for name in sorted(allowed - {ep.name for ep in found}):
            hint = _closest(name, [ep.name for ep in found])
            logger.warning(
                "the plugin allowlist (%s) names '%s', but no installed plugin has that "
                "entry-point name%s",
                _ALLOW_HINT, name, f"; did you mean '{hint}'?" if hint else "",
            )
    for ep in found:
        dist, version = _dist_of(ep)
        if allowed is not None and ep.name not in allowed:
            registry.disabled.append(ep.name)
            registry._disabled_reason[ep.name] = _why_disabled(ep.name, allow)
            logger.info("plugin '%s' (%s) %s", ep.name, dist, registry._disabled_reason[ep.name])
        elif copies := twice.get(normalized_name(getattr(ep, "dist", None)) or ""):
            message, imported, found_copies = refuse_copies(ep, copies)
            failure = PluginFailure(ep.name, dist, "duplicate", message, None, imported, found_copies)
            registry._fail(failure)
        else:
            _load_one(registry, ep, dist, version)


#: Seconds a plugin's import may take before it is reported and skipped (an import that
#: blocks on the network or a lock would hang ``rlcore plugins`` and ``rlcore run``).
IMPORT_TIMEOUT_ENV = "RLCORE_PLUGIN_IMPORT_TIMEOUT_S"
IMPORT_TIMEOUT_S = 120.0


class ImportStuck(Exception):
    """A plugin's import did not finish within :func:`import_timeout_s`."""


def import_timeout_s() -> float:
    """``$RLCORE_PLUGIN_IMPORT_TIMEOUT_S``, else :data:`IMPORT_TIMEOUT_S`."""
    raw = os.environ.get(IMPORT_TIMEOUT_ENV, "").strip()
    try:
        return float(raw) if raw else IMPORT_TIMEOUT_S
    except ValueError:
        logger.warning("%s=%r is not a number of seconds; using %g", IMPORT_TIMEOUT_ENV, raw, IMPORT_TIMEOUT_S)
        return IMPORT_TIMEOUT_S


def _load_within(ep: Any, timeout_s: float) -> object:
    """``ep.load()`` on a daemon thread, waited for ``timeout_s``: its result or its error;
    :class:`ImportStuck` naming where it was when the time ran out (the thread is left
    behind: an import cannot be interrupted, and a daemon thread does not hold the exit)."""
    done: dict[str, Any] = {}

    def load() -> None:
        try:
            done["plugin"] = ep.load()
        except BaseException as err:  # noqa: BLE001 - handed to the caller's thread
            done["error"] = err

    thread = threading.Thread(target=load, name=f"rlcore-import-{ep.name}", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise ImportStuck(f"its import did not finish within {timeout_s:g}s ({_where(thread)})")
    if "error" in done:
        raise done["error"]
    return done["plugin"]


def _where(thread: threading.Thread) -> str:
    """The innermost frame of ``thread`` outside the import machinery, as ``file:line in func``."""
    frame = sys._current_frames().get(thread.ident or -1)
    frames = traceback.extract_stack(frame) if frame is not None else []
    own = [f for f in frames if "importlib" not in f.filename and f.filename != threading.__file__]
    if not own:
        return "where, Python cannot tell"
    f = own[-1]
    return f"waiting at {f.filename}:{f.lineno} in {f.name}"


def _load_one(registry: Registry, ep: Any, dist: str | None, version: str | None) -> None:
    """Import one entry point and register its plugin; an import that fails, or does not
    finish within :func:`import_timeout_s`, is reported."""
    try:
        plugin = _load_within(ep, import_timeout_s())
    except (Exception, SystemExit) as err:  # noqa: BLE001 - incl. SyntaxError
        logger.debug("import of plugin '%s' failed", ep.name, exc_info=True)
        if isinstance(err, ImportStuck):
            why = (f"could not be imported: {err}. A plugin's import must not block (no network or locks at "
                   f"import time); to give it longer, set {IMPORT_TIMEOUT_ENV}")
        else:
            why = (f"failed to import '{getattr(ep, 'value', ep.name)}': {type(err).__name__}: {err}. Fix the "
                   "error or uninstall the distribution")
        registry._fail(PluginFailure(
            ep.name, dist, "import",
            f"{_origin(ep.name, dist, version)} {why}; to skip it, leave it out of the plugin allowlist ({_ALLOW_HINT}).",
            version=version,
        ))
        return
    location = dist_location(getattr(ep, "dist", None))
    registry._installed[ep.name] = InstalledCopy(ep.name, dist, version, location, True)
    registry.register(plugin, ep.name, dist, version)
