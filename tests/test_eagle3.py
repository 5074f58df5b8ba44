"""EAGLE-3 heads: official checkpoint layout, a reference computation, lossless generate, round trip, errors."""

import json

import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_model
from safetensors.torch import load_file, save_file

from hf_eagle2 import Eagle3DraftModel, EagleDraftModel
from hf_eagle2.engine.drafter import EagleDrafter, TreeOptions
from hf_eagle2.engine.target import TargetModel

H, V, N, LAYERS = 64, 32, 24, 8  # tiny Llama target with 8 layers: features are hidden_states[2], [4], [5]
DRAFT_IDS = torch.tensor([0, 1, 2, 3, 4, 6, 7, 9, 10, 11, 12, 14, 15, 17, 18, 19, 20, 22, 24, 25, 27, 28, 30, 31])


@pytest.fixture(scope="module")
def target():
    return tiny_model("llama", num_hidden_layers=LAYERS)


def official_eagle3_config(draft_vocab_size=N, **extra) -> dict:
    """A config.json as official EAGLE-3 heads ship it (Llama-style, LlamaForCausalLMEagle3)."""
    return {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "bos_token_id": 1, "eos_token_id": 2,
        "pad_token_id": 0, "hidden_act": "silu", "hidden_size": H, "initializer_range": 0.02,
        "intermediate_size": 128, "max_position_embeddings": 512, "num_attention_heads": 4,
        "num_key_value_heads": 2, "num_hidden_layers": 1, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "rope_scaling": None, "tie_word_embeddings": False, "torch_dtype": "float16",
        "transformers_version": "4.28.1", "use_cache": True, "vocab_size": V, "draft_vocab_size": draft_vocab_size,
        **extra,
    }  # fmt: skip


def official_eagle3_state(seed=0, draft_ids=DRAFT_IDS) -> dict:
    """Random tensors under the official EAGLE-3 names; d2t holds offsets (target = draft + d2t), t2d a mask."""
    g = torch.Generator().manual_seed(seed)
    n = draft_ids.numel()

    def w(*shape, scale=0.1):
        return torch.randn(*shape, generator=g) * scale

    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[draft_ids] = True
    return {
        "fc.weight": w(H, 3 * H),
        "midlayer.hidden_norm.weight": 1 + w(H),
        "midlayer.input_layernorm.weight": 1 + w(H),
        "midlayer.post_attention_layernorm.weight": 1 + w(H),
        "midlayer.self_attn.q_proj.weight": w(64, 2 * H),
        "midlayer.self_attn.k_proj.weight": w(32, 2 * H),
        "midlayer.self_attn.v_proj.weight": w(32, 2 * H),
        "midlayer.self_attn.o_proj.weight": w(H, 64),
        "midlayer.mlp.gate_proj.weight": w(128, H),
        "midlayer.mlp.up_proj.weight": w(128, H),
        "midlayer.mlp.down_proj.weight": w(H, 128),
        "norm.weight": 1 + w(H),
        "lm_head.weight": w(n, H, scale=1.0),
        "d2t": draft_ids - torch.arange(n),
        "t2d": t2d,
    }


def write_official(folder, state=None, config=None):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config or official_eagle3_config()))
    save_file(state if state is not None else official_eagle3_state(), str(folder / "model.safetensors"))
    return str(folder)


@pytest.fixture(scope="module")
def head_dir(tmp_path_factory):
    return write_official(tmp_path_factory.mktemp("eagle3"))


# ---------------------------------------------------------------- an independent reference of the official math
def _rms(x, w, eps=1e-6):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x, pos, theta=10000.0):
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2).float() / d)
    ang = pos.float()[:, None] * inv[None]
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
    rot = torch.cat([-x[..., d // 2 :], x[..., : d // 2]], -1)
    return x * cos + rot * sin


def reference_head(s, embeds, feats, pos):
    """Official EAGLE-3 midlayer over a causal sequence; embeds (T, H), feats (T, H) (already fc'd), pos (T,)."""
    x = torch.cat([_rms(embeds, s["midlayer.input_layernorm.weight"]), _rms(feats, s["midlayer.hidden_norm.weight"])], -1)
    q = (x @ s["midlayer.self_attn.q_proj.weight"].T).view(-1, 4, 16).transpose(0, 1)
    k = (x @ s["midlayer.self_attn.k_proj.weight"].T).view(-1, 2, 16).transpose(0, 1).repeat_interleave(2, 0)
    v = (x @ s["midlayer.self_attn.v_proj.weight"].T).view(-1, 2, 16).transpose(0, 1).repeat_interleave(2, 0)
    q, k = _rope(q, pos), _rope(k, pos)
    att = (q @ k.transpose(-1, -2)) / 4.0
    att = att.masked_fill(~torch.ones(len(pos), len(pos), dtype=torch.bool).tril(), float("-inf")).softmax(-1)
    h = feats + (att @ v).transpose(0, 1).reshape(len(pos), 64) @ s["midlayer.self_attn.o_proj.weight"].T
    m = _rms(h, s["midlayer.post_attention_layernorm.weight"])
    mlp = (F.silu(m @ s["midlayer.mlp.gate_proj.weight"].T) * (m @ s["midlayer.mlp.up_proj.weight"].T))
    return h + mlp @ s["midlayer.mlp.down_proj.weight"].T


def reference_logits(s, out):
    return _rms(out, s["norm.weight"]) @ s["lm_head.weight"].T


def test_target_features_are_three_layers_of_one_forward(target, head_dir):
    head = EagleDraftModel.from_pretrained(head_dir)
    assert type(head) is Eagle3DraftModel
    assert head.target_feature_ids(target) == (2, LAYERS // 2, LAYERS - 3)
    ids = torch.randint(3, V, (2, 9), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(9).expand(2, 9)
    full = target(ids, output_hidden_states=True).hidden_states
    feats, _ = TargetModel(target, feature_ids=head.target_feature_ids(target)).forward(ids, pos, None, None)
    assert feats.shape == (2, 9, 3 * H)
    torch.testing.assert_close(feats, torch.cat([full[2], full[4], full[5]], -1))


def test_drafted_chain_matches_reference(target, head_dir):
    """Depth 1 reads fc(target features); depth >= 2 reads the head's own pre-norm output at the parent."""
    s = official_eagle3_state()
    head = EagleDraftModel.from_pretrained(head_dir).bind(target)
    prompt = torch.randint(3, V, (1, 7), generator=torch.Generator().manual_seed(1))
    full = target(prompt, output_hidden_states=True).hidden_states
    feats = torch.cat([full[2], full[4], full[5]], -1)[0]  # (S, 3H)
    first = 5  # the root: the token after the prompt
    seq = torch.cat([prompt[0], torch.tensor([first])])
    depth = 4
    drafter = EagleDrafter(head, target, TreeOptions(tree="chain", depth=depth).resolved(torch.device("cpu")))
    drafter.add_features(feats[None])
    with torch.no_grad():
        tree = drafter.draft_tree(seq[None], torch.arange(len(seq))[None], max_depth=depth)
    # reference: run the head causally over context + chain, feeding its own outputs back
    embed = target.get_input_embeddings().weight
    with torch.no_grad():
        head_feats = list(feats @ s["fc.weight"].T)
        tokens = list(seq[1:])
        chain = []
        for _ in range(depth):
            out = reference_head(s, embed[torch.stack(tokens)], torch.stack(head_feats), torch.arange(len(tokens)))
            draft_id = int(reference_logits(s, out[-1]).argmax())
            chain.append(int(DRAFT_IDS[draft_id]))
            head_feats.append(out[-1])
            tokens.append(torch.tensor(chain[-1]))
    assert tree.tokens[0].tolist() == [first] + chain


@pytest.mark.parametrize("tree", ["eagle2", "eagle1", "chain"])
def test_greedy_identity(target, head_dir, tree):
    head = EagleDraftModel.from_pretrained(head_dir)
    for seed in range(2):
        ids = torch.randint(3, V, (1, 5 + seed), generator=torch.Generator().manual_seed(seed))
        ref = target.generate(ids, do_sample=False, max_new_tokens=16)
        out = target.generate(ids, do_sample=False, max_new_tokens=16, assistant_model=head, tree=tree)
        assert torch.equal(out, ref), (tree, seed)


def test_left_padded_batch_and_stock_loop(target, head_dir):
    head = EagleDraftModel.from_pretrained(head_dir)
    ids = torch.randint(3, V, (2, 8), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    ids[1, :3], mask[1, :3] = 0, 0
    ref = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=20)
    out = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=20, assistant_model=head,
                          tree="eagle2")  # fmt: skip
    assert torch.equal(out, ref)
    one = ids[:1]
    stock = target.generate(one, do_sample=False, max_new_tokens=16, assistant_model=head)  # stock assisted loop
    assert torch.equal(stock, target.generate(one, do_sample=False, max_new_tokens=16))


def test_sampling_runs(target, head_dir):
    head = EagleDraftModel.from_pretrained(head_dir)
    ids = torch.randint(3, V, (2, 6), generator=torch.Generator().manual_seed(4))
    torch.manual_seed(0)
    out = target.generate(ids, do_sample=True, temperature=0.8, top_k=0, max_new_tokens=20, assistant_model=head,
                          tree="eagle2", eos_token_id=None)  # fmt: skip
    assert out.shape == (2, 26) and int(out.min()) >= 0 and int(out.max()) < V


def test_save_pretrained_round_trip(tmp_path, head_dir):
    head = EagleDraftModel.from_pretrained(head_dir)
    head.save_pretrained(tmp_path / "saved")
    config = json.loads((tmp_path / "saved" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["model_type"] == "llama"
    assert config["draft_vocab_size"] == N and config["num_hidden_layers"] == 1 and "target_hidden_size" not in config
    saved = load_file(str(tmp_path / "saved" / "model.safetensors"))
    original = official_eagle3_state()
    assert sorted(saved) == sorted(original)
    for name, tensor in original.items():
        assert torch.equal(saved[name], tensor), name
    again = Eagle3DraftModel.from_pretrained(str(tmp_path / "saved"))
    for name, tensor in head.state_dict().items():
        assert torch.equal(again.state_dict()[name], tensor), name


def test_full_draft_vocabulary_and_own_embeddings(tmp_path, target):
    """draft_vocab_size = vocab (d2t all zero); a target_hidden_size other than hidden_size brings embed_tokens."""
    state = official_eagle3_state(draft_ids=torch.arange(V))
    state["d2t"][3] = 7  # as in the official code, a full draft vocabulary does not consult d2t
    folder = write_official(tmp_path / "full", state, official_eagle3_config(draft_vocab_size=V))
    head = EagleDraftModel.from_pretrained(folder)
    assert torch.equal(head.to_target_ids(torch.arange(V)), torch.arange(V))
    ids = torch.randint(3, V, (1, 6), generator=torch.Generator().manual_seed(5))
    assert torch.equal(target.generate(ids, do_sample=False, max_new_tokens=16, assistant_model=head, tree="eagle2"),
                       target.generate(ids, do_sample=False, max_new_tokens=16))  # fmt: skip
    wide = tiny_model("llama", num_hidden_layers=LAYERS, hidden_size=96, intermediate_size=128)
    state = official_eagle3_state()
    state["fc.weight"] = torch.randn(H, 3 * 96) * 0.1
    state["embed_tokens.weight"] = torch.randn(V, H)
    folder = write_official(tmp_path / "wide", state, official_eagle3_config(target_hidden_size=96))
    head = EagleDraftModel.from_pretrained(folder)
    assert head.owns_embeddings
    assert torch.equal(wide.generate(ids, do_sample=False, max_new_tokens=16, assistant_model=head, tree="eagle2",
                                     tree_total_tokens=12),  # a fixed budget: no cost measurement for this target
                       wide.generate(ids, do_sample=False, max_new_tokens=16))  # fmt: skip
    with pytest.raises(ValueError, match="width 96"):
        head.bind(target)


def test_loading_errors_are_clear(tmp_path):
    state = official_eagle3_state()
    state["midlayer.extra.weight"] = state.pop("midlayer.hidden_norm.weight")
    with pytest.raises(ValueError, match=r"EAGLE-3 head.*unexpected tensors \['midlayer.extra.weight'\].*missing "
                                         r"tensors \['midlayer.hidden_norm.weight'\]"):  # fmt: skip
        EagleDraftModel.from_pretrained(write_official(tmp_path / "names", state))
    state = official_eagle3_state()
    state["midlayer.self_attn.q_proj.weight"] = torch.zeros(64, H)  # an EAGLE-1/2 width, not 2H
    with pytest.raises(ValueError, match=r"midlayer.self_attn.q_proj.weight has shape \(64, 64\).*\(64, 128\)"):
        EagleDraftModel.from_pretrained(write_official(tmp_path / "shape", state))
    with pytest.raises(ValueError, match=r"tensor (d2t|lm_head.weight) has shape \(24,.*config expects \(20,"):
        EagleDraftModel.from_pretrained(write_official(tmp_path / "vocab", official_eagle3_state(),
                                                       official_eagle3_config(draft_vocab_size=20)))  # fmt: skip
    state = official_eagle3_state()
    state["t2d"][5] = True  # marks 25 target tokens for 24 draft tokens
    with pytest.raises(ValueError, match="d2t and t2d disagree"):
        EagleDraftModel.from_pretrained(write_official(tmp_path / "t2d", state))
    state = official_eagle3_state()
    state["d2t"][-1] = 5  # draft 23 -> target 28, which draft 21 already is
    with pytest.raises(ValueError, match="same target token"):
        EagleDraftModel.from_pretrained(write_official(tmp_path / "d2t", state))


def test_class_and_target_mismatches(tmp_path, target, head_dir):
    eagle12 = EagleDraftModel.from_target(target, seed=0)
    eagle12.save_pretrained(tmp_path / "eagle12")
    with pytest.raises(ValueError, match="EAGLE-1/2 head"):
        Eagle3DraftModel.from_pretrained(str(tmp_path / "eagle12"))
    assert type(Eagle3DraftModel.from_pretrained(head_dir)) is Eagle3DraftModel
    with pytest.raises(ValueError, match=r"entries in \[0, 2\)"):
        EagleDraftModel.from_pretrained(head_dir).bind(tiny_model("llama"))  # 2 layers: no layer 2 / L - 3


def test_eagle12_path_unchanged_by_the_feature_hooks(tmp_path, target):
    """EAGLE-1/2 heads still load as EagleDraftModel and read the final hidden state (feature ids (-1,))."""
    head = EagleDraftModel.from_target(target, seed=1)
    head.save_pretrained(tmp_path)
    loaded = EagleDraftModel.from_pretrained(str(tmp_path))
    assert type(loaded) is EagleDraftModel and loaded.target_feature_ids(target) == (-1,)
    ids = torch.randint(3, V, (1, 6), generator=torch.Generator().manual_seed(6))
    ref = target.generate(ids, do_sample=False, max_new_tokens=16)
    assert torch.equal(target.generate(ids, do_sample=False, max_new_tokens=16, assistant_model=loaded, tree="eagle2",
                                       tree_total_tokens=12), ref)  # fmt: skip
    assert torch.equal(target.generate(ids, do_sample=False, max_new_tokens=16, assistant_model=loaded), ref)


def test_from_target_sets_a_consistent_vocabulary(tmp_path, target):
    head = Eagle3DraftModel.from_target(target, draft_vocab=DRAFT_IDS, seed=2)
    assert torch.equal(head.to_target_ids(torch.arange(N)), DRAFT_IDS) and int(head.t2d.sum()) == N
    head.save_pretrained(tmp_path)
    loaded = EagleDraftModel.from_pretrained(str(tmp_path)).bind(target)
    assert torch.equal(loaded.to_target_ids(torch.arange(N)), DRAFT_IDS)
    with pytest.raises(NotImplementedError, match="own trained lm_head"):
        loaded.set_draft_vocab(None)


def test_accepted_blocks_carry_three_layer_features(tmp_path, target):
    """A one-token draft vocabulary holding the token the target ends up repeating: drafts get accepted, so rounds
    accept several tokens and their (3H-wide) features are gathered from the tree pass, also in a padded batch."""
    ids = torch.randint(3, V, (2, 6), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    ids[1, :2], mask[1, :2] = 0, 0
    ref = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=24)
    repeated = int(ref[0, -1])
    folder = write_official(tmp_path, official_eagle3_state(draft_ids=torch.tensor([repeated])),
                            official_eagle3_config(draft_vocab_size=1))  # fmt: skip
    head = EagleDraftModel.from_pretrained(folder)
    out = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=24, assistant_model=head,
                          tree="eagle2", tree_total_tokens=8, return_dict_in_generate=True)  # fmt: skip
    assert torch.equal(out.sequences, ref)
    assert out.eagle_stats.tau > 1.5, out.eagle_stats.tau
