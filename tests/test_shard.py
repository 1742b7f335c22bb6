"""Shard runtime: spans chained equal the full model; rollback, trees, batching and loading behave."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM

from beeswarm.shard import EntryModel, SessionError, ShardError, Span, SpanRuntime, StepInput, benchmark, checkpoint
from beeswarm.shard.families import SUPPORTED
from tiny_checkpoints import write_tiny_checkpoint

SPLITS = [(0, 3), (3, 5), (5, 8)]
FAMILIES = sorted(SUPPORTED)  # every supported family (conftest makes each)


def load_chain(folder, splits=SPLITS):
    entry = EntryModel(folder, dtype="float32", device="cpu")
    spans = [SpanRuntime(folder, Span(a, b), dtype="float32", device="cpu") for a, b in splits]
    return entry, spans


def run_chain(entry, spans, session, token_ids, start, tree_mask=None):
    hidden = entry.embed(token_ids)
    for span in spans:
        hidden = span.step_one(session, hidden, start, tree_mask)
    return entry.logits(hidden)


@pytest.mark.parametrize("family", FAMILIES)
def test_chained_spans_equal_the_full_model(tiny_models, family):
    folder = tiny_models[family]
    reference = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    entry, spans = load_chain(folder)
    for span in spans:
        span.open("s", 64)
    tokens = torch.tensor([5, 17, 99, 3, 200, 42, 7])
    logits = run_chain(entry, spans, "s", tokens, 0)
    with torch.no_grad():
        want = reference(tokens[None]).logits[0]
    torch.testing.assert_close(logits, want, atol=1e-4, rtol=0)
    for _ in range(20):
        nxt = logits[-1].argmax().view(1)
        tokens = torch.cat([tokens, nxt])
        logits = run_chain(entry, spans, "s", nxt, len(tokens) - 1)
        with torch.no_grad():
            want = reference(tokens[None]).logits[0, -1:]
        torch.testing.assert_close(logits, want, atol=1e-4, rtol=0)


def test_rollback_then_redo_equals_the_never_diverged_path(tiny_llama):
    entry, spans = load_chain(tiny_llama)
    for span in spans:
        span.open("a", 32)
        span.open("b", 32)
    prompt = torch.tensor([1, 2, 3, 4])
    run_chain(entry, spans, "a", prompt, 0)
    run_chain(entry, spans, "a", torch.tensor([50, 60, 70]), 4)  # a wrong guess, then roll back
    redo = run_chain(entry, spans, "a", torch.tensor([9, 10]), 4)
    straight = run_chain(entry, spans, "b", torch.tensor([1, 2, 3, 4, 9, 10]), 0)[-2:]
    torch.testing.assert_close(redo, straight, atol=1e-5, rtol=0)
    assert spans[0].length("a") == 6


def tree():
    # Node 0 is the root (the last accepted token); 1, 2 are its children; 3 is a child of 1.
    parents = [-1, 0, 0, 1]
    mask = torch.zeros(4, 4, dtype=torch.bool)
    for node, parent in enumerate(parents):
        mask[node, node] = True
        while parent >= 0:
            mask[node, parent] = True
            parent = parents[parent]
    return mask


def test_tree_masked_step_equals_each_path_run_separately(tiny_llama):
    entry, spans = load_chain(tiny_llama)
    prompt, tree_tokens = torch.tensor([11, 12, 13]), torch.tensor([20, 21, 22, 23])
    for span in spans:
        for s in ("tree", "p1", "p2"):
            span.open(s, 32)
    for s in ("tree", "p1", "p2"):
        run_chain(entry, spans, s, prompt, 0)
    tree_logits = run_chain(entry, spans, "tree", tree_tokens, 3, tree())
    path1 = run_chain(entry, spans, "p1", tree_tokens[[0, 1, 3]], 3)  # 20 -> 21 -> 23
    path2 = run_chain(entry, spans, "p2", tree_tokens[[0, 2]], 3)  # 20 -> 22
    torch.testing.assert_close(tree_logits[[0, 1, 3]], path1, atol=1e-5, rtol=0)
    torch.testing.assert_close(tree_logits[[0, 2]], path2, atol=1e-5, rtol=0)

    # keep() the accepted path 0 -> 1 -> 3; the next step then matches the straight run.
    for span in spans:
        span.keep("tree", 3, [0, 1, 3])
    nxt = torch.tensor([77])
    torch.testing.assert_close(run_chain(entry, spans, "tree", nxt, 6), run_chain(entry, spans, "p1", nxt, 6),
                               atol=1e-5, rtol=0)


def test_batched_sessions_equal_unbatched(tiny_llama):
    span = SpanRuntime(tiny_llama, Span(0, 8), dtype="float32", device="cpu")
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randn(n, span.hidden_size, generator=gen) for n in (5, 1, 9)]
    for i in range(3):
        span.open(f"batch{i}", 40)
        span.open(f"solo{i}", 40)
    batched = span.step([StepInput(f"batch{i}", p, 0) for i, p in enumerate(prompts)])
    solo = [span.step_one(f"solo{i}", p, 0) for i, p in enumerate(prompts)]
    for a, b in zip(batched, solo):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    # Next: sessions at different positions, one decoding, one rolling back, one sending a tree.
    steps = [(torch.randn(1, span.hidden_size, generator=gen), 5, None),
             (torch.randn(3, span.hidden_size, generator=gen), 1, None),
             (torch.randn(4, span.hidden_size, generator=gen), 4, tree())]
    batched = span.step([StepInput(f"batch{i}", h, s, m) for i, (h, s, m) in enumerate(steps)])
    solo = [span.step_one(f"solo{i}", h, s, m) for i, (h, s, m) in enumerate(steps)]
    for a, b in zip(batched, solo):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_loading_two_of_eight_layers_reads_only_their_tensors(tiny_models, family, monkeypatch):
    read = []
    real_safe_open = checkpoint.safe_open

    class Spy:
        def __init__(self, path, **kw):
            self.inner = real_safe_open(path, **kw)

        def __enter__(self):
            self.handle = self.inner.__enter__()
            return self

        def __exit__(self, *exc):
            return self.inner.__exit__(*exc)

        def keys(self):
            return self.handle.keys()

        def get_tensor(self, name):
            read.append(name)
            return self.handle.get_tensor(name)

    monkeypatch.setattr(checkpoint, "safe_open", Spy)
    runtime = SpanRuntime(tiny_models[family], Span(2, 4), dtype="float32", device="cpu")
    assert len(runtime.layers) == 2
    assert read and {int(name.split(".")[2]) for name in read} == {2, 3}
    assert all(name.startswith(("model.layers.2.", "model.layers.3.")) for name in read)
    # what the planner counts per layer is what a loaded layer holds (a MoE layer: every expert)
    held = sum(p.numel() * p.element_size() for p in runtime.layers[0].parameters())
    assert held == benchmark.layer_bytes(runtime.config, torch.float32)


def test_span_out_of_range_and_missing_tensors_are_named(tiny_llama, tmp_path):
    with pytest.raises(ShardError, match=r"out of range.*\[0, 8\)"):
        SpanRuntime(tiny_llama, Span(6, 9), device="cpu")
    broken = tmp_path / "broken"
    shutil.copytree(tiny_llama, broken)
    index = json.loads((broken / checkpoint.INDEX).read_text())
    del index["weight_map"]["model.layers.5.mlp.up_proj.weight"]
    (broken / checkpoint.INDEX).write_text(json.dumps(index))
    with pytest.raises(ShardError, match="model.layers.5.mlp.up_proj.weight"):
        SpanRuntime(broken, Span(4, 6), device="cpu")
    SpanRuntime(broken, Span(0, 4), device="cpu")  # other layers still load


def test_unsupported_architecture_names_the_supported_ones(tiny_llama, tmp_path):
    other = tmp_path / "gpt2ish"
    shutil.copytree(tiny_llama, other)
    config = json.loads((other / "config.json").read_text())
    config["model_type"] = "gpt2"
    (other / "config.json").write_text(json.dumps(config))
    with pytest.raises(ShardError, match="not supported; supported: gemma2, gemma3_text, llama, mistral, mixtral, "
                                         "phi3, qwen2, qwen3, qwen3_moe$"):
        SpanRuntime(other, Span(0, 1), device="cpu")


def test_bad_steps_raise_session_errors_and_leave_the_session_usable(tiny_llama):
    span = SpanRuntime(tiny_llama, Span(0, 2), dtype="float32", device="cpu")
    span.open("s", 8)
    h = torch.randn(3, span.hidden_size)
    with pytest.raises(SessionError, match="unknown session"):
        span.step_one("nope", h, 0)
    with pytest.raises(SessionError, match="start 2 is past"):
        span.step_one("s", h, 2)
    with pytest.raises(SessionError, match="past max_length"):
        span.step_one("s", torch.randn(9, span.hidden_size), 0)
    with pytest.raises(SessionError, match="hidden: shape"):
        span.step_one("s", torch.randn(3, 5), 0)
    with pytest.raises(SessionError, match="tree_mask"):
        span.step_one("s", h, 0, torch.ones(3, 3, dtype=torch.bool))
    with pytest.raises(SessionError, match="outside"):
        span.open("huge", 10**9)
    assert span.step_one("s", h, 0).shape == (3, span.hidden_size)
    assert span.length("s") == 3
    span.close("s")
    with pytest.raises(SessionError, match="unknown session"):
        span.length("s")


def test_tied_embeddings_load_without_lm_head(tmp_path):
    folder = write_tiny_checkpoint(tmp_path / "tied", "llama", num_layers=2, tie_word_embeddings=True)
    entry = EntryModel(folder, dtype="float32", device="cpu")
    assert entry.lm_head.weight.data_ptr() == entry.embedding.weight.data_ptr()


def test_hub_id_fetches_only_the_files_the_span_needs(tiny_llama, tmp_path, monkeypatch):
    import huggingface_hub
    from huggingface_hub.errors import EntryNotFoundError

    snapshot = tmp_path / "snapshot"
    snapshot.mkdir()
    asked = []

    def fake_download(repo_id, filename, revision=None, tqdm_class=None, **_):
        assert repo_id == "org/tiny"
        asked.append(filename)
        source = tiny_llama / filename
        if not source.exists():
            raise EntryNotFoundError(f"{filename} not found")
        size = source.stat().st_size
        bar = tqdm_class(total=size, unit="B", unit_scale=True, desc=filename)  # as the hub's downloader does
        bar.update(size // 2)
        bar.update(size - size // 2)
        bar.close()
        shutil.copy(source, snapshot / filename)
        return str(snapshot / filename)

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fake_download)
    downloaded, built = {}, []
    runtime = SpanRuntime.load("org/tiny", Span(2, 4), dtype="float32", device="cpu",
                               on_bytes=lambda file, done, total: downloaded.__setitem__(file, (done, total)),
                               on_layer=lambda done, total: built.append((done, total)))
    assert all(downloaded[f] == ((tiny_llama / f).stat().st_size,) * 2 for f in asked if (tiny_llama / f).exists())
    assert built == [(1, 2), (2, 2)]
    weight_map = json.loads((tiny_llama / checkpoint.INDEX).read_text())["weight_map"]
    needed = {f for name, f in weight_map.items() if name.startswith(("model.layers.2.", "model.layers.3."))}
    shards = {f for f in asked if f.endswith(".safetensors")}
    assert shards == needed and len(shards) < len(set(weight_map.values()))
    assert "config.json" in asked and checkpoint.INDEX in asked and "tokenizer.json" in asked
    assert len(runtime.layers) == 2


def test_bad_model_reference_is_explained(tmp_path):
    with pytest.raises(ShardError, match="not a built-in name"):
        checkpoint.resolve("no such thing")
    with pytest.raises(ShardError, match="no config.json"):
        checkpoint.resolve(str(tmp_path))


def test_offloaded_layers_stream_the_same_weights_and_give_the_same_outputs(tiny_llama):
    """Half the span's weights in host memory, streamed in per pass (host to host on CPU): same numbers."""
    resident = SpanRuntime(tiny_llama, Span(1, 7), dtype="float32", device="cpu")
    offloaded = SpanRuntime(tiny_llama, Span(1, 7), dtype="float32", device="cpu", offload_fraction=0.5)
    assert len(offloaded.layers) == 3 and len(offloaded.offloaded) == 3 and offloaded.offloaded.host_bytes > 0
    # Each streamed buffer holds a bit-exact copy of the right layer's weights (a copy, so exact).
    for j, layer in enumerate(offloaded.offloaded.layers()):
        want = resident.layers[3 + j]
        assert layer.self_attn.layer_idx == want.self_attn.layer_idx
        for (name, got), (_, expected) in zip(layer.named_parameters(), want.named_parameters(), strict=True):
            assert torch.equal(got, expected), f"offloaded layer {j}: {name}"
    gen = torch.Generator().manual_seed(3)
    for runtime in (resident, offloaded):
        runtime.open("s", 16)
    steps = [(torch.randn(5, resident.hidden_size, generator=gen), 0),
             (torch.randn(1, resident.hidden_size, generator=gen), 5),
             (torch.randn(3, resident.hidden_size, generator=gen), 4)]  # a rollback too
    for hidden, start in steps:
        # Same weights in other buffers: torch's CPU matmul (MKL) may pick its kernel by CPU and buffer
        # alignment, so float32 sums can reassociate (~1e-6 relative per op; ~1e-6 absolute seen after six
        # layers on outputs of size ~5). torch's own float32 tolerances cover that; a wrong, stale or
        # half-copied layer is off by O(1).
        torch.testing.assert_close(offloaded.step_one("s", hidden, start), resident.step_one("s", hidden, start),
                                   rtol=1.3e-6, atol=1e-5)
    with pytest.raises(ShardError, match="offload_fraction"):
        SpanRuntime(tiny_llama, Span(0, 2), device="cpu", offload_fraction=1.5)
