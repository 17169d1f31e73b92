"""Paris's expert and router networks: the port's parameter names and sizes, strict loading of
a release's component directories, and architecture inferred from the weights' shapes."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from ddm.checkpoints.format import CheckpointError
from ddm.models.paris import (ParisExpert, ParisExpertConfig, ParisExpertGroup, ParisRouter,
                              ParisRouterConfig, grouped_forward_unsupported)
from ddm.models.paris_loading import (infer_expert_config, infer_router_config,
                                      load_paris_expert, load_paris_router)
from tests.support.paris_release import TinyParis, write_paris_release

EXPERT_WEIGHTS = "diffusion_pytorch_model.safetensors"
ROUTER_WEIGHTS = "pytorch_model.safetensors"


@pytest.fixture(scope="module")
def release(tmp_path_factory) -> Path:
    return write_paris_release(tmp_path_factory.mktemp("paris") / "release")


@pytest.fixture
def expert_dir(release, tmp_path) -> Path:
    return Path(shutil.copytree(release / "expert_0", tmp_path / "expert_0"))


def meta_shapes(network: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    return {name: tuple(t.shape) for name, t in network.state_dict().items()}


def rewrite_weights(directory: Path, name: str, change) -> None:
    weights = load_file(str(directory / name))
    change(weights)
    save_file(weights, str(directory / name))


def test_the_tiny_release_has_the_release_layout(release):
    assert sorted(p.name for p in release.iterdir()) == [
        "config.json", "expert_0", "expert_1", "model_index.json", "router", "text_encoder",
        "tokenizer", "vae"]
    for expert in ("expert_0", "expert_1"):
        assert sorted(p.name for p in (release / expert).iterdir()) == ["config.json",
                                                                         EXPERT_WEIGHTS]
    assert sorted(p.name for p in (release / "router").iterdir()) == ["config.json",
                                                                       ROUTER_WEIGHTS]
    index = json.loads((release / "model_index.json").read_text())
    assert index["vae"] == ["diffusers", "AutoencoderKL"]
    assert index["text_encoder"] == ["transformers", "CLIPTextModel"]


def test_full_size_networks_have_the_release_parameter_counts_and_the_port_names():
    with torch.device("meta"):
        expert, router = ParisExpert(), ParisRouter()
    # The release's DiT-XL/2 expert (605M) and DiT-B router (129M), counted from the port.
    assert sum(p.numel() for p in expert.parameters()) == 605_970_448
    assert sum(p.numel() for p in router.parameters()) == 129_136_904
    expert_names, router_names = set(expert.state_dict()), set(router.state_dict())
    assert {"patch_embed.weight", "pos_embed", "time_embed.mlp.0.weight", "text_proj.weight",
            "t_block.1.weight", "layers.27.scale_shift_table", "layers.27.attn.in_proj_weight",
            "layers.27.cross_attn.out_proj.bias", "layers.27.mlp.2.weight",
            "final_layer.linear.weight", "final_layer.scale_shift_table"} <= expert_names
    assert {"cls_token", "layers.11.adaLN_modulation.1.weight", "layers.11.attn.in_proj_bias",
            "head.0.weight", "head.2.weight", "head.4.weight"} <= router_names
    assert expert.state_dict()["text_proj.weight"].shape == (1152, 768)
    assert router.state_dict()["head.4.weight"].shape == (8, 768)


def test_full_size_architecture_is_inferred_from_the_weights_shapes_alone():
    with torch.device("meta"):
        expert, router = ParisExpert(), ParisRouter()
    assert infer_expert_config(meta_shapes(expert)) == ParisExpertConfig()
    assert infer_router_config(meta_shapes(router)) == ParisRouterConfig()


def test_release_components_load_strictly_and_run(release):
    sizes = TinyParis()
    expert = load_paris_expert(release / "expert_1")
    router = load_paris_router(release / "router")
    assert expert.config == sizes.expert and router.config == sizes.router
    assert not expert.training and not router.training
    x = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(0))
    timestep = torch.tensor([1000.0, 20.0])
    with torch.no_grad():
        assert expert(x, timestep, torch.zeros(2, 77, 32)).shape == (2, 4, 8, 8)
        assert router(x, timestep).shape == (2, 2)


def test_without_config_json_the_sizes_come_from_the_weights(expert_dir):
    (expert_dir / "config.json").unlink()
    config = load_paris_expert(expert_dir).config
    # Every size but num_heads is in the weights; num_heads falls back to the release's 16.
    assert config == ParisExpertConfig(input_size=8, hidden_size=32, depth=2, num_heads=16,
                                       text_embed_dim=32)


def test_a_router_whose_width_takes_no_12_heads_needs_num_heads_in_config_json(release,
                                                                                tmp_path):
    router_dir = Path(shutil.copytree(release / "router", tmp_path / "router"))
    (router_dir / "config.json").unlink()
    with pytest.raises(CheckpointError, match="num_heads"):
        load_paris_router(router_dir)


def test_config_json_that_disagrees_with_the_weights_is_refused_naming_the_field(expert_dir):
    config = json.loads((expert_dir / "config.json").read_text())
    (expert_dir / "config.json").write_text(json.dumps({**config, "hidden_size": 64,
                                                        "_class_name": "DiTExpert"}))
    with pytest.raises(CheckpointError, match=r"hidden_size: config.json says 64, the weights "
                                              r"have 32"):
        load_paris_expert(expert_dir)


@pytest.mark.parametrize("change, named", [
    (lambda w: w.pop("layers.1.cross_attn.in_proj_bias"),
     "missing layers.1.cross_attn.in_proj_bias"),
    (lambda w: w.update({"layers.0.attn.bias_k": torch.zeros(1, 1, 32)}),
     "unexpected layers.0.attn.bias_k"),
    (lambda w: w.update({"layers.1.scale_shift_table": torch.zeros(7, 32)}),
     r"layers.1.scale_shift_table has shape \(7, 32\), the architecture needs \(6, 32\)"),
])
def test_a_missing_extra_or_misshapen_tensor_is_refused_by_name(expert_dir, change, named):
    rewrite_weights(expert_dir, EXPERT_WEIGHTS, change)
    with pytest.raises(CheckpointError, match=named):
        load_paris_expert(expert_dir)


@pytest.mark.parametrize("block, named", [
    (20000, r"the weights name transformer block 20000 \(layers.20000.\*\); a network has at "
            r"most 256 blocks"),
    (3, r"the weights' transformer blocks are not layers.0 .. layers.3: layers.2.\* is "
        r"missing"),
], ids=["depth-bomb", "gap"])
def test_a_depth_read_from_the_weights_is_bounded_before_the_network_is_built(
        expert_dir, monkeypatch, block, named):
    # a 72-byte zero-element tensor named block 20000 once had 20001 blocks built (1.1 GB,
    # 27 s) before the strict key check refused it; no config.json states the depth
    (expert_dir / "config.json").unlink()
    rewrite_weights(expert_dir, EXPERT_WEIGHTS,
                    lambda w: w.update({f"layers.{block}.attn.in_proj_bias": torch.zeros(0)}))
    built = []
    monkeypatch.setattr(ParisExpert, "__init__", lambda *args, **kwargs: built.append(args))
    with pytest.raises(CheckpointError, match=named):
        load_paris_expert(expert_dir)
    assert built == []


def test_every_name_and_shape_is_checked_before_a_tensor_is_read(expert_dir, monkeypatch):
    rewrite_weights(expert_dir, EXPERT_WEIGHTS,
                    lambda w: w.update({"layers.0.attn.bias_k": torch.zeros(1, 1, 32)}))
    monkeypatch.setattr("ddm.models.paris_loading.load_file", lambda *args: pytest.fail(
        "the weights were read before their names were checked"))
    with pytest.raises(CheckpointError, match="unexpected layers.0.attn.bias_k"):
        load_paris_expert(expert_dir)


def test_weights_missing_what_the_architecture_is_read_from_are_refused_by_name(expert_dir):
    rewrite_weights(expert_dir, EXPERT_WEIGHTS, lambda w: w.pop("text_proj.weight"))
    with pytest.raises(CheckpointError, match="no text_proj.weight"):
        load_paris_expert(expert_dir)


def test_a_component_must_hold_exactly_one_weight_file(release, expert_dir):
    shutil.copy(release / "router" / ROUTER_WEIGHTS, expert_dir / ROUTER_WEIGHTS)
    with pytest.raises(CheckpointError, match="exactly one of"):
        load_paris_expert(expert_dir)
    (expert_dir / ROUTER_WEIGHTS).unlink()
    (expert_dir / EXPERT_WEIGHTS).unlink()
    with pytest.raises(CheckpointError, match="found neither"):
        load_paris_expert(expert_dir)


def test_malformed_config_json_is_refused(expert_dir):
    (expert_dir / "config.json").write_text("[1, 2]")
    with pytest.raises(CheckpointError, match="JSON object"):
        load_paris_expert(expert_dir)
    (expert_dir / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        load_paris_expert(expert_dir)


def test_weights_keep_their_dtype_unless_one_is_asked_for(expert_dir):
    rewrite_weights(expert_dir, EXPERT_WEIGHTS,
                    lambda w: w.update({k: v.to(torch.bfloat16) for k, v in w.items()}))
    assert {p.dtype for p in load_paris_expert(expert_dir).parameters()} == {torch.bfloat16}
    as_float = load_paris_expert(expert_dir, dtype=torch.float32)
    assert {p.dtype for p in as_float.parameters()} == {torch.float32}


def _pytorch_attention(ours: torch.nn.Module, width: int, heads: int) -> torch.nn.Module:
    """``nn.MultiheadAttention`` holding ``ours``' weights: the port's module."""
    theirs = torch.nn.MultiheadAttention(width, heads, batch_first=True).eval()
    theirs.load_state_dict(ours.state_dict(), strict=True)
    return theirs


def test_attention_is_pytorch_s_multihead_attention_on_the_same_weights():
    """Self- and cross-attention as nn.MultiheadAttention computes them (fast path and
    composite path both), from the same initialisation for the same seed."""
    from ddm.models.paris import Attention

    width, heads = 48, 4
    torch.manual_seed(3)
    ours = Attention(width, heads).eval()
    torch.manual_seed(3)
    theirs = torch.nn.MultiheadAttention(width, heads, batch_first=True).eval()
    for name, value in theirs.state_dict().items():
        torch.testing.assert_close(ours.state_dict()[name], value, rtol=0, atol=0)
    with torch.no_grad():  # random biases: PyTorch's initialisation leaves them zero
        for parameter in ours.parameters():
            parameter.normal_(std=0.2)
    theirs = _pytorch_attention(ours, width, heads)
    x, text = torch.randn(3, 16, width), torch.randn(3, 7, width)
    fast_path = torch.backends.mha.get_fastpath_enabled()
    try:
        for fast in (True, False):
            torch.backends.mha.set_fastpath_enabled(fast)
            with torch.inference_mode():
                torch.testing.assert_close(ours(x), theirs(x, x, x, need_weights=False)[0],
                                           rtol=1e-5, atol=1e-5)
                torch.testing.assert_close(ours(x, text),
                                           theirs(x, text, text, need_weights=False)[0],
                                           rtol=1e-5, atol=1e-5)
    finally:
        torch.backends.mha.set_fastpath_enabled(fast_path)


def test_an_expert_block_is_pixart_s_block_on_the_port_s_modules():
    """The block against PixArt-alpha's formula written out on nn.MultiheadAttention and
    nn.LayerNorm: modulated self-attention and MLP under gates, plain cross-attention."""
    from ddm.models.paris import ExpertBlock

    width, heads = 48, 4
    torch.manual_seed(4)
    block = ExpertBlock(width, heads, 4.0).eval()
    with torch.no_grad():
        for parameter in block.parameters():
            parameter.normal_(std=0.2)
    attn = _pytorch_attention(block.attn, width, heads)
    cross = _pytorch_attention(block.cross_attn, width, heads)
    norm = torch.nn.LayerNorm(width, elementwise_affine=False)
    x, time, text = torch.randn(2, 16, width), torch.randn(2, 6, width), torch.randn(2, 5, width)
    shift1, scale1, gate1, shift2, scale2, gate2 = (block.scale_shift_table[None] + time
                                                    ).chunk(6, dim=1)
    with torch.inference_mode():
        h = norm(x) * (1 + scale1) + shift1
        expected = x + gate1 * attn(h, h, h, need_weights=False)[0]
        expected = expected + cross(expected, text, text, need_weights=False)[0]
        expected = expected + gate2 * block.mlp(norm(expected) * (1 + scale2) + shift2)
        torch.testing.assert_close(block(x, time, text), expected, rtol=1e-4, atol=1e-4)


def test_an_expert_copies_its_activations_once_not_in_every_block():
    """The tokens are made token-major once, after the patch embedding: no block's layer norm
    or projection copies the (rows, tokens, width) activations again (on an H200 those copies
    were 18% of a 64-row forward's kernel time)."""
    from torch.profiler import ProfilerActivity, profile

    config = ParisExpertConfig(input_size=8, hidden_size=32, depth=3, num_heads=4,
                               text_embed_dim=24)
    network = ParisExpert(**config.to_dict()).eval()
    args = (torch.randn(2, 4, 8, 8), torch.rand(2) * 1000, torch.randn(2, 77, 24))
    with torch.inference_mode(), profile(activities=[ProfilerActivity.CPU],
                                         record_shapes=True) as profiler:
        network(*args)
    copied = [event.input_shapes[0] for event in profiler.events() if event.name == "aten::clone"]
    assert copied.count([2, 16, 32]) == 1, copied


GROUP_CONFIG = ParisExpertConfig(input_size=8, hidden_size=32, depth=2, num_heads=4,
                                 text_embed_dim=24)


def _distinct_experts(count: int, seed: int) -> list[ParisExpert]:
    """``count`` small experts whose every weight differs (a zero-initialised table or gate
    would hide a mix-up of experts)."""
    torch.manual_seed(seed)
    experts = [ParisExpert(**GROUP_CONFIG.to_dict()).eval() for _ in range(count)]
    with torch.no_grad():
        for expert in experts:
            for parameter in expert.parameters():
                parameter.normal_(std=0.2)
    return experts


def test_a_group_runs_each_row_through_its_own_expert_in_any_order():
    """Eight experts, top-2 style: rows of three of them interleaved, five experts with no
    row. Each row comes back as its own expert alone computes it (a mix-up of weights, rows
    or the order back would not)."""
    experts = _distinct_experts(8, seed=5)
    members = torch.tensor([6, 1, 6, 3, 1, 6, 1])
    latents, timestep = torch.randn(7, 4, 8, 8), torch.rand(7) * 1000
    text = torch.randn(7, 77, 24)
    with torch.inference_mode():
        alone = torch.cat([experts[int(k)](latents[[row]], timestep[[row]], text[[row]])
                           for row, k in enumerate(members)])
        grouped = ParisExpertGroup(experts)(latents, timestep, text, members)
    torch.testing.assert_close(grouped, alone, rtol=1e-5, atol=1e-5)
    assert (alone[0] - experts[1](latents[:1], timestep[:1], text[:1])).abs().max() > 0.1


def test_a_group_holds_no_second_copy_and_each_expert_still_runs_alone():
    experts = _distinct_experts(2, seed=6)
    latents, timestep, text = torch.randn(2, 4, 8, 8), torch.rand(2) * 1000, torch.randn(
        2, 77, 24)
    with torch.inference_mode():
        before = experts[1](latents, timestep, text)
        group = ParisExpertGroup(experts)
        after = experts[1](latents, timestep, text)
    torch.testing.assert_close(after, before, rtol=0, atol=0)
    stacked = group.stacked("layers.1.mlp.0.weight")
    assert stacked.shape == (2, 128, 32)
    weight = experts[1].layers[1].mlp[0].weight
    assert weight.untyped_storage().data_ptr() == stacked.untyped_storage().data_ptr()
    assert weight.data_ptr() == stacked[1].data_ptr()


@pytest.mark.parametrize("change, named", [
    (lambda experts: experts.append(ParisExpert(**{**GROUP_CONFIG.to_dict(), "depth": 3})),
     "expert 2 cannot join the group: its architecture"),
    (lambda experts: experts.append(ParisExpert(**GROUP_CONFIG.to_dict()).double()),
     "expert 2 cannot join the group: it runs in torch.float64"),
    (lambda experts: experts.clear(), "a group needs at least one expert")])
def test_experts_that_cannot_share_a_forward_are_refused_by_index(change, named):
    experts = _distinct_experts(2, seed=7)
    change(experts)
    with pytest.raises(ValueError, match=named):
        ParisExpertGroup(experts)


def test_the_grouped_forward_says_where_it_cannot_run():
    """``F.grouped_mm``'s own limits, as the group checks them before a pool relies on it."""
    cpu = torch.device("cpu")
    assert grouped_forward_unsupported(GROUP_CONFIG, torch.float32, cpu) is None
    assert grouped_forward_unsupported(GROUP_CONFIG, torch.bfloat16, cpu) is None
    odd = ParisExpertConfig(input_size=8, hidden_size=36, depth=1, num_heads=4,
                            text_embed_dim=24)
    assert "hidden_size (36) in torch.bfloat16 is not a multiple of 16 bytes" in (
        grouped_forward_unsupported(odd, torch.bfloat16, cpu))
    assert "on CUDA take bfloat16" in grouped_forward_unsupported(
        GROUP_CONFIG, torch.float32, torch.device("cuda"))
    assert "not meta" in grouped_forward_unsupported(GROUP_CONFIG, torch.float32,
                                                     torch.device("meta"))
    assert "compiled grouped matrix product takes bfloat16" in grouped_forward_unsupported(
        GROUP_CONFIG, torch.float32, cpu, compiled=True)
    assert grouped_forward_unsupported(GROUP_CONFIG, torch.bfloat16, cpu, compiled=True) is None
