"""Verification as one rule object (docs/DESIGN.md, Seams: verification rules).

A verify call's rows carry proposals; the rule decides which of them the target accepts. Each
rule is one `VerifyRule`, asked by every side that needs it:

    rule = verify_rules.get(name)            "chain", "block" or "tree" (contract.VERIFY_RULES)
    rule.effective(sampling)                 the rule a program of that sampling is exported with
    rule.inputs(io) / rule.outputs(io)       its extra program inputs / outputs (contract specs)
    rule.acceptance                          its in-graph acceptance (modeling/sampler.py)
    rule.describe                            how an export names it (refusals, messages)

A program (modeling/target.py, `ExportTarget.verify_rules`) declares the rules it supports; the
exporter refuses any other by name. The runtime looks its verifier up by `rule.name`.

This module imports contract-level code only, so every stage (exporter, runtime) may import it.
"""

from __future__ import annotations

from dataclasses import dataclass

from dflash_qaic.contract import (
    BATCH,
    BLOCK,
    CHAIN,
    NUM_ACCEPTED,
    SEQ,
    TREE,
    TREE_MASK,
    VERIFY_RULES,
    TensorSpec,
)

__all__ = ["BLOCK", "CHAIN", "RULES", "TREE", "VERIFY_RULES", "VerifyRule", "get"]


@dataclass(frozen=True)
class VerifyRule:
    """One verification rule (contract.py's comment on CHAIN / BLOCK / TREE gives the rows).

    name: the rule's name in the manifest and on the command line.
    acceptance: the in-graph acceptance, a function of modeling/sampler.py by this name.
    sampled_only: the rule differs from the chain only when the program samples (a greedy
    program with it is a chain program).
    takes_tree: the program takes TREE_MASK (rows are a tree's nodes at start + depth).
    counts_accepted: the program returns NUM_ACCEPTED (the accepted count decided in the graph).
    path_order: outputs in the accepted path's order, caches written after acceptance.
    flag: the export option that asks for it (for messages).
    """

    name: str
    acceptance: str
    sampled_only: bool = False
    takes_tree: bool = False
    counts_accepted: bool = False
    path_order: bool = False
    flag: str = ""

    @property
    def describe(self) -> str:
        """The rule as a message names it: 'block verification (--verify-rule block)'."""
        return f"{self.name} verification" + (f" ({self.flag})" if self.flag else "")

    def effective(self, sampling: bool) -> VerifyRule:
        """The rule a program of this sampling is exported with: a sampled-only rule on a
        greedy program is the chain."""
        return CHAIN_RULE if self.sampled_only and not sampling else self

    def inputs(self, io) -> list[TensorSpec]:
        """The program inputs this rule adds (io: the program's contract.TargetIO)."""
        return [TensorSpec(TREE_MASK, "int32", (BATCH, SEQ, SEQ))] if self.takes_tree else []

    def outputs(self, io) -> list[TensorSpec]:
        """The program outputs this rule adds."""
        counts = self.counts_accepted and (io.sampling or not self.sampled_only)
        return [TensorSpec(NUM_ACCEPTED, "int64", (BATCH,))] if counts else []


CHAIN_RULE = VerifyRule(CHAIN, acceptance="sample_chain")
BLOCK_RULE = VerifyRule(
    BLOCK,
    acceptance="sample_block",
    sampled_only=True,
    counts_accepted=True,
    flag="--verify-rule block",
)
TREE_RULE = VerifyRule(
    TREE,
    acceptance="sample_tree",
    takes_tree=True,
    counts_accepted=True,
    path_order=True,
    flag="--tree-budgets",
)
RULES: dict[str, VerifyRule] = {r.name: r for r in (CHAIN_RULE, BLOCK_RULE, TREE_RULE)}
assert tuple(RULES) == VERIFY_RULES  # the contract's names, in its order


def get(name: str | VerifyRule) -> VerifyRule:
    """The rule of this name (a rule passes through); a clear error for any other."""
    if isinstance(name, VerifyRule):
        return name
    if name not in RULES:
        raise ValueError(f"unknown verify rule {name!r}: choose from {', '.join(RULES)}")
    return RULES[name]
