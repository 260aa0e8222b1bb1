"""lmsbench/models.py on the CPU: the GPT that the benchmarks and the regression suite share,
built the same way for both, and the ResNet builder's checks."""

from __future__ import annotations

import pytest

pytest.importorskip("torch.nn", reason="needs a torch wheel (the CPU one is enough)")
import torch

from lmsbench.models import GPT, GPTConfig, resnet

SMALL = GPTConfig(vocab=97, seq=16, dim=32, layers=3, heads=4)


def test_gpt_shapes_and_parameter_count() -> None:
    torch.manual_seed(0)
    model = GPT(SMALL)
    idx = torch.randint(0, SMALL.vocab, (2, SMALL.seq))
    assert model(idx).shape == (2, SMALL.seq, SMALL.vocab)
    assert sum(p.numel() for p in model.parameters()) == SMALL.parameter_count()


@pytest.mark.parametrize(
    "config", [GPTConfig(dim=30, heads=4), GPTConfig(layers=0), GPTConfig(vocab=0)]
)
def test_gpt_config_validation(config: GPTConfig) -> None:
    with pytest.raises(ValueError):
        config.validate()


def test_modules_are_built_in_one_order_whatever_the_attention() -> None:
    """The recorded regression runs depend on it: one seed, the same parameters in the same
    order, whichever attention the model runs (the initialization aside)."""
    names = [
        "tokens.weight",
        "positions.weight",
        *(
            f"blocks.{i}.{p}"
            for i in range(SMALL.layers)
            for p in (
                "ln1.weight",
                "ln1.bias",
                "attn.qkv.weight",
                "attn.qkv.bias",
                "attn.proj.weight",
                "attn.proj.bias",
                "ln2.weight",
                "ln2.bias",
                "mlp.0.weight",
                "mlp.0.bias",
                "mlp.2.weight",
                "mlp.2.bias",
            )
        ),
        "ln.weight",
        "ln.bias",
        "head.weight",
    ]
    built = []
    for fused in (True, False):
        torch.manual_seed(0)
        model = GPT(SMALL, fused_attention=fused, gpt2_init=False)
        assert [n for n, _ in model.named_parameters()] == names
        built.append([p.detach() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*built))


def test_explicit_attention_matches_the_fused_one() -> None:
    torch.manual_seed(0)
    fused = GPT(SMALL, fused_attention=True)
    explicit = GPT(SMALL, fused_attention=False)
    explicit.load_state_dict(fused.state_dict())
    idx = torch.randint(0, SMALL.vocab, (2, SMALL.seq))
    torch.testing.assert_close(explicit(idx), fused(idx))
    # Causal: a later token does not change the logits of the earlier ones.
    changed = idx.clone()
    changed[:, -1] = (changed[:, -1] + 1) % SMALL.vocab
    torch.testing.assert_close(explicit(changed)[:, :-1], explicit(idx)[:, :-1])


def test_tied_head_is_the_token_embedding() -> None:
    model = GPT(SMALL, tied=True, gpt2_init=False)
    assert model.head.weight is model.tokens.weight
    tied = sum(p.numel() for p in model.parameters())
    assert tied == SMALL.parameter_count() - SMALL.vocab * SMALL.dim


def test_gpt2_initialization_scales_the_residual_projections() -> None:
    torch.manual_seed(0)
    config = GPTConfig(vocab=512, seq=16, dim=256, layers=8, heads=4)
    model = GPT(config)
    proj = model.blocks[0].attn.proj.weight.std().item()
    qkv = model.blocks[0].attn.qkv.weight.std().item()
    assert abs(qkv - 0.02) < 0.002
    assert abs(proj - 0.02 / (2 * config.layers) ** 0.5) < 0.001
    assert torch.equal(model.blocks[0].ln1.weight, torch.ones(config.dim))


def test_resnet_depths() -> None:
    with pytest.raises(ValueError, match="no ResNet-42"):
        resnet(42, 10)
