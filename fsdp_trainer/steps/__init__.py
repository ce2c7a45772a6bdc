"""One room per training kind: what its step computes, how it is evaluated, what it needs from the house (base.py says
what a kind is asked). A new kind is a file here with a Step subclass, and a line in KINDS."""

from __future__ import annotations

from typing import Any

from fsdp_trainer.steps.base import DATA_KINDS, Step, data_kind
from fsdp_trainer.steps.distill import DistillStep
from fsdp_trainer.steps.grpo import GRPOStep
from fsdp_trainer.steps.kto import KTOStep
from fsdp_trainer.steps.next_token import NextTokenStep
from fsdp_trainer.steps.orpo import ORPOStep
from fsdp_trainer.steps.preference import PreferenceStep
from fsdp_trainer.steps.reward import RewardStep
from fsdp_trainer.steps.simpo import SimPOStep

KINDS: tuple[type[Step], ...] = (
    GRPOStep,
    PreferenceStep,
    SimPOStep,
    ORPOStep,
    KTOStep,
    RewardStep,
    DistillStep,
    NextTokenStep,
)
"""The kinds, asked in this order whether a recipe wants them; next-token prediction, the last, when no other is."""


def training_kind(recipe: Any) -> type[Step]:
    """The kind a recipe (or a checkpoint's recipe sections, as attributes) trains."""
    return next(kind for kind in KINDS if kind.wanted(recipe))


def check_data(recipe: Any, train_file: Any) -> None:
    """A kind trains on its kind of data, and data of a kind trains only the kinds made for it: ValueError naming the
    file and what to set."""
    kind, held = training_kind(recipe), data_kind(train_file)
    if held == kind.trains_on:
        return
    if held == "tokens":
        raise ValueError(
            f"the {kind.name} kind trains on {DATA_KINDS[kind.trains_on]}, and {train_file.path} holds none: "
            f"prepare the data with {kind.prepared_with}"
        )
    fits = next(other for other in KINDS if other.trains_on == held)
    raise ValueError(
        f"{train_file.path} holds {DATA_KINDS[held]}, and the {kind.name} kind this recipe asks for trains on "
        f"{DATA_KINDS[kind.trains_on]}: prepare them with {kind.prepared_with}, or {fits.chosen_by} to train on these"
    )
