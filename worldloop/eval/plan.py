"""What an evaluation plays: one :class:`EnvPlan` per env on ``--envs``, one :class:`Episode` per
(env, held-out seed)."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

from worldloop.common.contracts.config import ConfigError


@dataclass(frozen=True)
class EnvPlan:
    name: str  # as given on --envs (preset name or gymnasium id)
    env_id: str
    kwargs: dict = field(hash=False)  # everything passed to gymnasium.make
    max_turns: int = 3
    prompt_format: str = ""  # effective values (the env's defaults when not given)
    state_format: str = ""

    def make(self):
        return make_checked(self.name, self.env_id, self.kwargs)


@dataclass
class Episode:
    plan: EnvPlan
    seed: int
    key: str


def make_checked(name: str, env_id: str, kwargs: dict):
    import gymnasium

    from worldloop import envs  # noqa: F401  (registers the ids)

    try:
        return gymnasium.make(env_id, **copy.deepcopy(kwargs))
    except (ValueError, TypeError) as e:
        raise ConfigError("--envs", f"env {name!r} ({env_id}) cannot be built with {kwargs}: {e}") from None
    except gymnasium.error.Error as e:
        raise ConfigError("--envs", f"env {name!r}: {e}") from None
