"""What a fit returns: each rank's output, and the merged timeline when it was recorded."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from pytest_ddphooks import Timeline


@dataclass
class RankOutput:
    """What one rank reports at the end of a fit (written to a file by a launched rank)."""

    rank: int
    rank_info: dict[str, int]
    losses: list[float]
    params: dict[str, torch.Tensor]
    sharded: list[str]  # parameters of which ``params`` holds this rank's dim-0 shard only
    metrics: dict[str, Any] = field(default_factory=dict)
    resumed_from: int | None = None  # the epoch of the checkpoint the fit resumed from

    def to_dict(self) -> dict[str, Any]:
        return dict(vars(self))


@dataclass
class FitResult:
    """The outcome of ``fit``: one RankOutput per rank this process knows of, and the timeline.

    A trainer-launched fit knows every rank; an in-process fit (single, external) only its own.
    """

    ranks: dict[int, RankOutput]
    timeline: Timeline | None = None

    @property
    def first(self) -> RankOutput:
        return self.ranks[min(self.ranks)]

    @property
    def losses(self) -> list[float]:
        """The training losses of the lowest rank known, one per step (of its own batch)."""
        return self.first.losses

    @property
    def initial_loss(self) -> float:
        return self.losses[0]

    @property
    def final_loss(self) -> float:
        return self.losses[-1]

    @property
    def world_size(self) -> int:
        return self.first.rank_info["world_size"]

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The final parameters; FSDP shards are put back together when every rank is known."""
        first = self.first
        complete = len(self.ranks) == self.world_size
        out = {}
        for name, value in first.params.items():
            if name in first.sharded and complete:
                value = torch.cat([self.ranks[r].params[name] for r in sorted(self.ranks)], dim=0)
            out[name] = value
        return out
