"""What a server engine declares about itself beyond the engine protocol: one object per engine.

A :class:`ServerDescriptor` holds everything the rest of the house would otherwise look up by an engine's
name: the arms the engine can set up and how (each arm's flags, the words for its change and its proof,
the engine argument its installed source must declare), why it cannot set up the others, what its prefix
cache holds and how it is emptied, which counter counts its preemptions, the readers of the facts that
prove an arm (the KV cache dtype, the prefix cache's unit, the requests it runs at once), whether it
tokenizes on the server, and the standard-library parsers a reproducer pastes to read its answers.

An engine's factory carries it on its :class:`~specparity.engines.base.EngineInfo` (``descriptor=``), so
``specparity.engines.server_descriptor(name_or_spec)`` finds it for a built-in engine and for a plugin
(``--engine mypkg.mod:create``) alike; generic code (:mod:`specparity.engines.server.arm_knobs`, the
arms' run, the reproducers) reads the descriptor and never branches on an engine's name.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from specparity.engines.base import EngineOptions
from specparity.engines.server.arm_sizing import ArmLaunch, ArmSizing

#: Reads one fact from one server: (the engine adapter, one of its endpoints) -> the value, None when the
#: server does not say.
EndpointReader = Callable[[Any, Any], Any]


@dataclass(frozen=True)
class ArmKnob:
    """How an engine sets up one arm: ``launch`` turns the run's sizing and options into the change to both
    launches; ``changes`` and ``proof`` say in words what it changes and what shows it happened (for the arms'
    table, messages and docs); ``argument``: the engine argument the launch needs, looked for in the installed
    engine's source before any launch (None: nothing to check)."""

    changes: str
    proof: str
    launch: Callable[[ArmSizing, EngineOptions], ArmLaunch]
    argument: str | None = None


def no_change(_sizing: ArmSizing, _options: EngineOptions) -> ArmLaunch:
    """An arm that changes nothing in the launches (the default arm; a warm-up arm on a cache that is on)."""
    return ArmLaunch()


@dataclass(frozen=True)
class PrefixCache:
    """The engine's prefix cache as the arms see it. ``unit``: tokens per cached unit where the server does
    not say (``read_unit`` per endpoint, named by ``unit_source``, wins); ``reset``: the route that empties it
    (None: none), ``reset_ok`` whether the route's answer says it did; ``absent``: why requests never read a
    prefix cache (None: they may); ``needs``: what a server needs for its answers to carry cached tokens;
    ``key_tokens_lost(spec_config)``: prompt tokens a hit is shorter by because of how the cache is keyed;
    ``units_dropped(spec_config)``: whole units the engine recomputes of every hit for this speculative
    config; ``floor_words(spec_config, unit)``: why a warm prompt must be longer than one unit (None: it
    need not)."""

    unit: int = 1
    read_unit: EndpointReader | None = None
    unit_source: str = ""
    reset: str | None = None
    reset_ok: Callable[[str], bool] = lambda _text: True
    absent: str | None = None
    needs: str | None = None
    key_tokens_lost: Callable[[Mapping[str, Any]], int] = lambda _config: 0
    units_dropped: Callable[[Mapping[str, Any]], int] = lambda _config: 0
    floor_words: Callable[[Mapping[str, Any], int], str | None] = lambda _config, _unit: None


@dataclass(frozen=True)
class ServerDescriptor:
    """One server engine's own facts (see the module docstring). ``every_arm``: what every arm adds to both
    launches besides its own knob (``every_arm_argument`` the engine argument it needs); ``argument_sources``:
    the installed package's files that declare its arguments (``package`` the distribution; ``source_check``
    whether the installed source can be read for these options: not where the servers run from another
    environment); ``preemption_counter``: (the /metrics counter, a sample present whenever the metrics are on),
    None when it has none, ``no_preemption`` why it never preempts; ``read_kv_cache_dtype`` and
    ``read_running_cap``: readers of the arms' proofs (None: the engine does not say);
    ``tokenizes_on_server``: prompts are sent as text and sized by characters; ``repro_parse`` and
    ``repro_row_parse``: standard-library Python defining ``parse(answer)`` and ``rows_of(answer, kind,
    prompt_len)`` for a reproducer's ``repro.py``."""

    name: str
    arms: Mapping[str, ArmKnob]
    unsupported_arms: Mapping[str, str] = field(default_factory=dict)
    every_arm: ArmLaunch = ArmLaunch()
    every_arm_argument: str | None = None
    package: str | None = None
    argument_sources: tuple[str, ...] = ()
    source_check: Callable[[EngineOptions], bool] = lambda _options: True
    prefix_cache: PrefixCache = PrefixCache()
    preemption_counter: tuple[str, str] | None = None
    no_preemption: str | None = None
    read_kv_cache_dtype: EndpointReader | None = None
    read_running_cap: EndpointReader | None = None
    tokenizes_on_server: bool = False
    #: The speculative server's argv for these options (its preset and ``--engine-opt server_args``); None: not
    #: known before launch. ValueError / KeyError / TypeError when the options name no launch (servers at URLs).
    spec_launch_args: Callable[[EngineOptions], list[str]] | None = None
    repro_parse: str = ""
    repro_row_parse: str = ""

    def supports(self, arm: str) -> bool:
        return arm in self.arms
