"""Training-step parity: the trainer, its data, trajectories and distributed runs."""

from torchparity.train.trainer import (
    Execution,
    StepRecord,
    TrainConfig,
    Trainer,
    Trajectory,
    deterministic,
    train,
)

__all__ = ["Execution", "StepRecord", "TrainConfig", "Trainer", "Trajectory", "deterministic",
           "train"]
