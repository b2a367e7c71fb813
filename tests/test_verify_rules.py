"""Verification as one rule object (dflash_qaic/contract.py): every rule's extra program
inputs and outputs are the contract's, its acceptance is a function of the graph's sampler, and
the exporter refuses a rule the program does not support, by name."""

import dataclasses

import pytest

from dflash_qaic import contract
from dflash_qaic.modeling import sampler

IO = contract.TargetIO(n_layers=2, n_kv_heads=2, head_dim=8, hidden_size=16, vocab_size=32)
EXTRA = {contract.TREE_MASK, contract.NUM_ACCEPTED}


@pytest.mark.parametrize("sampling", [True, False])
@pytest.mark.parametrize("name", contract.VERIFY_RULES)
def test_rule_io_is_the_contracts(name, sampling):
    """The rule a program of this sampling is exported with adds exactly the inputs and outputs
    contract.TargetIO lists for it (a greedy block program is a chain program)."""
    rule = contract.rule(name).effective(sampling)
    io = dataclasses.replace(IO, sampling=sampling, verify_rule=rule.name)
    assert rule.inputs(io) == [s for s in io.inputs if s.name in EXTRA]
    assert rule.outputs(io) == [s for s in io.outputs if s.name in EXTRA]
    assert (rule.name == contract.BLOCK) == (name == contract.BLOCK and sampling)


def test_each_rule_names_its_acceptance():
    assert tuple(contract.RULES) == contract.VERIFY_RULES
    for rule in contract.RULES.values():
        assert rule.acceptance in sampler.ACCEPTANCE, rule
        assert rule.describe.startswith(f"{rule.name} verification")
    assert sampler.ACCEPTANCE["sample_chain"] is sampler.sample_next_tokens


def test_unknown_rule_is_refused_by_name():
    with pytest.raises(ValueError, match="unknown verify rule 'sideways': choose from chain"):
        contract.rule("sideways")
