"""A small, real trainer over plain torch with a Lightning-like hook lifecycle.

It exists to be tested: its hook order is documented in ``reference_trainer.trainer``, its
barriers and model moves are instrumentable, and ``bugs`` re-introduces historical ordering
mistakes one at a time, so pytest-ddphooks can be shown to catch each of them.
"""

from .bugs import BUGS
from .hooks import Callback, DataModule, Module
from .instrument import instrument_strategy, instrument_trainer
from .launch import RankError
from .strategies import (
    STRATEGIES,
    DDPSpawnStrategy,
    DDPStrategy,
    DistributedStrategy,
    ExternalStrategy,
    FSDPStrategy,
    SingleStrategy,
    Strategy,
    make_strategy,
)
from .task import ParamSyncCheck, RegressionDataModule, RegressionModule
from .trainer import LIFECYCLE, ORDER, FitResult, RankOutput, Trainer

__all__ = [
    "BUGS",
    "LIFECYCLE",
    "ORDER",
    "STRATEGIES",
    "Callback",
    "DDPSpawnStrategy",
    "DDPStrategy",
    "DataModule",
    "DistributedStrategy",
    "ExternalStrategy",
    "FSDPStrategy",
    "FitResult",
    "Module",
    "ParamSyncCheck",
    "RankError",
    "RankOutput",
    "RegressionDataModule",
    "RegressionModule",
    "SingleStrategy",
    "Strategy",
    "Trainer",
    "instrument_strategy",
    "instrument_trainer",
    "make_strategy",
]
