"""A model a framework hands over already sharded with FSDP2: accept it, or refuse with the fix.

Lightning's ``ModelParallelStrategy`` lets the user shard in ``configure_model``, before any
precision hook runs. FSDP2 fixes how each parameter is stored, gathered and reduced when
``fully_shard`` runs, so an opt level that casts weights (O2, O3) must have been applied there,
by `mixprec.fully_shard`, at the integration's own level and dtype; O0 and O1 cast nothing and
run on torch's ``fully_shard`` as it is. Accepted, the model needs no cast and no masters (FSDP's
fp32 shards are the masters): the integration adds only the optimizer side, as
``mixprec.initialize`` does for such a model (`mixprec.distributed.wrapping`).

Everything here reads Python objects only: no collective, no device access.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from mixprec.distributed.fsdp import sharded_options, sharding_mismatch
from mixprec.distributed.topology import fsdp_modules
from mixprec.dtypes import dtype_name
from mixprec.integrations.errors import IntegrationError
from mixprec.levels.presets import AmpOptions

__all__ = ["check_sharded"]


def check_sharded(
    module: nn.Module, options: AmpOptions, given: Mapping[str, Any], policy: Any = None
) -> set[int]:
    """Check that `module`, sharded with FSDP2, can train at `options`; return the ids of the
    parameters inside modules sharded by `mixprec.fully_shard`.

    Args:
        module: the model the framework trains (a sharded network may be one of its children).
        options: the integration's resolved level.
        given: the option overrides the user gave the integration (``AmpConfig.options``).
        policy: the op policy the user gave the integration, if any.

    Raises:
        IntegrationError: O2/O3 on a model sharded by torch's ``fully_shard``; a level, dtype or
            model-side option other than the sharding's; O2/O3 parameters outside the modules
            sharded by `mixprec.fully_shard`. Nothing is changed.
    """
    level, low = options.level.value, dtype_name(options.dtype)
    casts = options.cast_model_type not in (None, torch.float32)  # O2, O3
    units = fsdp_modules(module)
    roots = [(name, m, sharded_options(m)) for name, m in units]
    roots = [(name, m, o) for name, m, o in roots if o is not None]
    if not roots and casts:
        raise IntegrationError(
            f"{_where(units[0][0])} of {type(module).__name__} is sharded with torch's "
            f"fully_shard, without mixprec's policies. Under FSDP2, {level}'s {low} weights are "
            f"FSDP's own mixed precision (its fp32 shards are the master weights), chosen when "
            f"sharding: in configure_model call mixprec.fully_shard(module, opt_level={level!r}, "
            f"dtype={low!r}, mesh=...) instead of fully_shard. O0 and O1 run on a model sharded "
            f"with torch's fully_shard as it is."
        )
    given = dict(given)
    if policy is not None:
        given["policy"] = policy
    for name, _, sharded in roots:
        _check_same(name, sharded, options, given)
    inside = {id(p) for _, m, _ in roots for p in m.parameters()}
    if casts:
        outside = [n for n, p in module.named_parameters()
                   if p.is_floating_point() and id(p) not in inside]  # fmt: skip
        if outside:
            raise IntegrationError(
                f"{len(outside)} parameter(s) of {type(module).__name__} (the first is "
                f"{outside[0]!r}) lie outside the modules sharded by mixprec.fully_shard, so "
                f"{level} would leave them in fp32 with no policy. Shard the module that holds "
                f"every parameter with mixprec.fully_shard (name blocks with units=)."
            )
    return inside


def _check_same(name: str, sharded: AmpOptions, options: AmpOptions, given: dict) -> None:
    level, low = options.level.value, dtype_name(options.dtype)
    theirs, their_low = sharded.level.value, dtype_name(sharded.dtype)
    key = sharding_mismatch(sharded, options, given)
    if key == "level":
        raise IntegrationError(
            f"{_where(name)} was sharded by mixprec.fully_shard at {theirs} ({their_low}), which "
            f"fixed how its weights are stored, gathered and reduced; the precision plugin runs "
            f"{level} ({low}). Give both the same level and dtype: mixprec.fully_shard(..., "
            f"opt_level={theirs!r}, dtype={their_low!r}) and the plugin's ({theirs!r}, "
            f"dtype={their_low!r})."
        )
    if key is not None:
        raise IntegrationError(
            f"the plugin's {key}={given[key]!r} differs from what mixprec.fully_shard applied "
            f"to {_where(name)} ({key}={getattr(sharded, key)!r}); model-side options are "
            f"fixed when sharding. Pass {key} to mixprec.fully_shard only."
        )


def _where(name: str) -> str:
    return f"submodule {name!r}" if name else "the model"
