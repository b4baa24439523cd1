"""Hugging Face integration: native models, exact conversion, training, lm-eval, refusals."""

import json
import re

import pytest
import torch

transformers = pytest.importorskip("transformers")

import attnres.hf  # noqa: E402  (registers the Auto classes)
from attnres import ModelConfig  # noqa: E402
from attnres.hf import AttnResConfig, AttnResForCausalLM, byte_tokenizer, convert, freeze_base, routing_parameters  # noqa: E402
from attnres.hf.finetune import finetune  # noqa: E402
from attnres.train.config import DataConfig  # noqa: E402
from attnres.train.data import load_corpus  # noqa: E402

from tests.hf_cases import ids, run_convert, saved_source, source_model  # noqa: E402

AutoModelForCausalLM = transformers.AutoModelForCausalLM


@pytest.mark.parametrize("kind", ["llama", "qwen3", "qwen2", "mistral", "mixtral", "qwen3_moe"])
def test_conversion_is_exact_in_fp32(kind):
    src = source_model(kind)
    conv = convert(src, heads=4, block_layers=2)
    x = ids()
    assert torch.equal(conv(input_ids=x).logits, src(input_ids=x).logits)
    assert conv.config.model_type == f"attnres_{kind}"
    # the base weights are untouched
    for name, p in src.state_dict().items():
        assert torch.equal(conv.state_dict()[name], p), name


def test_qwen3_head_dim_differs_from_hidden_over_heads():
    src = source_model("qwen3")
    assert src.config.head_dim * src.config.num_attention_heads != src.config.hidden_size
    assert src.model.layers[0].self_attn.q_norm is not None


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_perturbing_routing_changes_logits(kind):
    src = source_model(kind)
    conv = convert(src, heads=4, block_layers=2)
    with torch.no_grad():
        conv.routing.gates.fill_(0.5)
        conv.routing.pseudo_queries.normal_()
    x = ids()
    assert (conv(input_ids=x).logits - src(input_ids=x).logits).abs().max() > 1e-3


def test_save_load_roundtrip_and_generation(tmp_path):
    src = source_model("qwen3")
    src.save_pretrained(tmp_path / "src")
    byte_tokenizer().save_pretrained(tmp_path / "src")
    proc = run_convert(tmp_path / "src", tmp_path / "dst")
    assert proc.returncode == 0, proc.stderr
    M, D = 2 * 4, 64
    added = 2 * (M + 1) * D + D + (M + 1)  # pseudo-queries, key gains, null, gates
    assert f"added {added:,} routing parameters" in proc.stdout
    assert (tmp_path / "dst" / "tokenizer.json").exists()
    config = json.loads((tmp_path / "dst" / "config.json").read_text())
    assert config["model_type"] == "attnres_qwen3" and config["delta_heads"] == 4
    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "dst"))
    assert type(loaded).__name__ == "AttnResQwen3ForCausalLM"
    x = ids()
    assert torch.equal(loaded(input_ids=x).logits, src(input_ids=x).logits)
    prompt = ids(b=1, t=6)
    a = src.generate(prompt, max_new_tokens=10, do_sample=False)
    b = loaded.generate(prompt, max_new_tokens=10, do_sample=False)
    assert torch.equal(a, b)


def test_native_model_roundtrip_tokenizer_and_generate(tmp_path):
    torch.manual_seed(0)
    mc = ModelConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, residual="block",
                     num_blocks=2, heads=2, max_seq_len=128, tie_embeddings=True)
    model = AttnResForCausalLM(AttnResConfig.from_model_config(mc))
    with torch.no_grad():
        model.model.stream.pseudo_queries.normal_()
    tok = byte_tokenizer()
    text = "def f(x):\n    return 'héllo'"
    assert tok(text)["input_ids"] == list(text.encode()) and tok.decode(list(text.encode())) == text
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path))
    assert isinstance(loaded, AttnResForCausalLM)
    assert loaded.model.lm_head.weight is loaded.model.tok_embeddings.weight
    x = torch.tensor([list(text.encode())])
    assert torch.equal(loaded(input_ids=x).logits, model(input_ids=x).logits)
    assert torch.equal(loaded.generate(x, max_new_tokens=12, do_sample=False), model.model.generate(x, 12))
    out = loaded(input_ids=x, labels=x)
    assert torch.isfinite(out.loss)


def test_continued_pretraining_moves_every_routing_parameter():
    src = source_model("llama")
    conv = convert(src, heads=4, block_layers=2)
    freeze_base(conv)
    assert {n for n, p in conv.named_parameters() if p.requires_grad} == set(routing_parameters(conv))
    tokens = load_corpus(DataConfig(max_train_tokens=300_000, max_val_tokens=1), 256).train
    initial = {n: p.detach().clone() for n, p in routing_parameters(conv).items()}
    grads_at_zero, moved = {}, []

    def record(step, model):
        named = routing_parameters(model)
        moved.append({n for n in named if not torch.equal(named[n], initial[n])})

    # step 0's gradients, before any update
    x = torch.from_numpy(tokens[:65].astype("int64"))[None]
    loss = torch.nn.functional.cross_entropy(conv(input_ids=x[:, :-1]).logits[0], x[0, 1:])
    loss.backward()
    for n, p in routing_parameters(conv).items():
        assert p.grad is not None, n
        grads_at_zero[n] = float(p.grad.abs().max())
    conv.zero_grad()
    assert {n for n, g in grads_at_zero.items() if g > 0} == {"routing.gates"}
    losses = finetune(conv, tokens, steps=30, batch_size=4, seq_len=64, lr=1e-2, routing_only=True, on_step=record)
    assert moved[0] == {"routing.gates"}
    assert moved[1] == {"routing.gates", "routing.pseudo_queries", "routing.null"}
    assert moved[2] == set(initial)  # the key gains follow once the queries are non-zero
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.05
    for name, p in src.state_dict().items():  # the frozen base is untouched
        assert torch.equal(conv.state_dict()[name], p)


def test_full_finetune_lowers_the_loss():
    conv = convert(source_model("qwen3"), heads=4, block_layers=2)
    tokens = load_corpus(DataConfig(max_train_tokens=300_000, max_val_tokens=1), 256).train
    losses = finetune(conv, tokens, steps=25, batch_size=4, seq_len=64, lr=3e-3)
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.5


def test_unsupported_models_are_refused():
    bert = transformers.BertForMaskedLM(transformers.BertConfig(
        vocab_size=300, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64))
    with pytest.raises(ValueError, match=r"cannot convert model_type='bert'.*\['llama', 'mistral', 'mixtral', 'qwen2', 'qwen3', 'qwen3_moe'\]"):
        convert(bert)
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=300, n_embd=32, n_layer=1, n_head=2))
    with pytest.raises(ValueError, match="cannot convert model_type='gpt2'"):
        convert(gpt2)
    with pytest.raises(ValueError, match=r"heads=5 must be a positive integer dividing hidden_size=64"):
        convert(source_model("llama"), heads=5)
    with pytest.raises(ValueError, match=r"block_layers=9 must be an integer in \[1, 4\]"):
        convert(source_model("llama"), heads=4, block_layers=9)


TASK = """task: attnres_tiny
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{label}}}}"
target_delimiter: " "
metric_list:
  - metric: acc
"""

DOCS = [
    {"context": "def add(a, b):\n    return", "choices": ["a + b", "banana"], "label": 0},
    {"context": "import os\nprint(os.path.", "choices": ["join('x')", "zzz"], "label": 0},
    {"context": "for i in", "choices": ["range(10):", "!!!"], "label": 0},
]


@pytest.fixture(scope="module", autouse=True)
def one_task_index():
    """lm-eval indexes its ~14,000 bundled task files for every ``TaskManager`` (8 s): the
    module's evaluations share one index per set of arguments. ``evaluate`` imports the class
    when it runs, so the shared one is what it finds."""
    try:
        from lm_eval import tasks
    except ImportError:  # the lm-eval tests skip themselves
        yield
        return
    built, original = {}, tasks.TaskManager

    def shared(*args, **kwargs):
        key = repr((args, sorted(kwargs.items())))
        if key not in built:
            built[key] = original(*args, **kwargs)
        return built[key]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(tasks, "TaskManager", shared)
        yield


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tasks")
    data = d / "docs.jsonl"
    data.write_text("".join(json.dumps(doc) + "\n" for doc in DOCS))
    (d / "attnres_tiny.yaml").write_text(TASK.format(data=data))
    return d


def own_loglikelihood(model, context: str, continuation: str) -> float:
    ctx, cont = list(context.encode()), list(continuation.encode())
    x = torch.tensor([ctx + cont])
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=x[:, :-1]).logits.double(), -1)[0]
    return float(sum(logp[len(ctx) - 1 + k, t] for k, t in enumerate(cont)))


@pytest.mark.slow
@pytest.mark.xdist_group("lm_eval")  # one worker indexes the tasks once (one_task_index)
@pytest.mark.parametrize("kind", ["native", "converted", "converted-moe"])
def test_lm_eval_loglikelihoods_match_the_model(kind, task_dir, tmp_path):
    pytest.importorskip("lm_eval")
    if kind == "native":
        torch.manual_seed(1)
        model = AttnResForCausalLM(AttnResConfig.from_model_config(ModelConfig(
            vocab_size=256, dim=32, n_layers=2, n_heads=2, residual="full", max_seq_len=128)))
    else:
        model = convert(source_model("llama" if kind == "converted" else "mixtral"), heads=4, block_layers=2)
    model.save_pretrained(tmp_path)
    byte_tokenizer().save_pretrained(tmp_path)
    from attnres.hf.evaluate import evaluate

    out = evaluate(tmp_path, ["attnres_tiny"], include_path=str(task_dir), log_samples=True)
    assert 0.0 <= out["results"]["attnres_tiny"]["acc,none"] <= 1.0
    reloaded = AutoModelForCausalLM.from_pretrained(str(tmp_path)).eval()
    samples = out["samples"]["attnres_tiny"]
    assert len(samples) == len(DOCS)
    for sample in samples:
        doc = sample["doc"]
        lls = [r[0][0] for r in sample["resps"]]
        expected = [own_loglikelihood(reloaded, doc["context"], " " + c) for c in doc["choices"]]
        assert lls == pytest.approx(expected, abs=1e-4)


@pytest.mark.slow
@pytest.mark.xdist_group("lm_eval")
@pytest.mark.parametrize("args,message", [
    (["--tasks", "no_such_task"], r"unknown lm-eval task\(s\) \['no_such_task'\]"),
    (["--tasks", "hellaswag", "--limit", "0"], r"limit=0 must be a positive number of examples per task, a fraction in \(0, 1\)"),
    (["--tasks", "hellaswag", "--batch-size", "0"], r"batch_size=0 must be >= 1"),
    (["--tasks", "hellaswag", "--device", "gpu"], r"device='gpu' is not a torch device"),
])
def test_eval_refuses_bad_arguments_before_loading_the_model(tmp_path, capsys, monkeypatch, args, message):
    from attnres.cli import main
    from attnres.hf import evaluate as evaluate_module

    src, _ = saved_source(tmp_path)
    capsys.readouterr()
    monkeypatch.setattr(evaluate_module, "lm_eval_model", lambda *a, **k: pytest.fail("the model was loaded"))
    assert main(["eval", str(src), *args]) == 2
    err = capsys.readouterr().err
    assert re.match(rf"attnres eval: error: {message}", err) and "Traceback" not in err, err


def test_uneven_blocks_convert_exactly_and_round_trip(tmp_path):
    """--block-layers 1,3: a block of one layer, then one of three (block_sizes (2, 6) in
    sublayers); exact at step 0, saved as a list, loaded back; off the zero init it routes other
    sources than equal blocks do; generation with the cache equals generation without."""
    src, _ = saved_source(tmp_path)
    assert run_convert(src, tmp_path / "dst").returncode == 0  # the equal-blocks twin: --block-layers 2
    proc = run_convert(src, tmp_path / "uneven", block_layers="1,3")
    assert proc.returncode == 0, proc.stderr
    config = json.loads((tmp_path / "uneven" / "config.json").read_text())
    assert config["delta_block_layers"] == [1, 3]
    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "uneven"))
    assert loaded.routing.block_sizes == (2, 6) and loaded.routing.num_blocks == 2
    source = AutoModelForCausalLM.from_pretrained(str(src))
    x = ids()
    assert torch.equal(loaded(input_ids=x).logits, source(input_ids=x).logits)
    # off the zero init, the routing reads its two blocks: other logits than the equal blocks'
    equal = AutoModelForCausalLM.from_pretrained(str(tmp_path / "dst"))
    with torch.no_grad():
        for model in (loaded, equal):
            model.routing.gates.fill_(0.5)
            model.routing.pseudo_queries.normal_(generator=torch.Generator().manual_seed(0))
    assert not torch.allclose(loaded(input_ids=x).logits, equal(input_ids=x).logits)
    assert torch.equal(loaded.generate(ids(b=1, t=5), max_new_tokens=6, do_sample=False),
                       loaded.generate(ids(b=1, t=5), max_new_tokens=6, do_sample=False, use_cache=False))


@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe"])
def test_moe_models_convert_save_load_and_generate_as_their_source(kind, tmp_path):
    """A tiny Mixtral or Qwen3-MoE saved as a Hugging Face folder, converted by the command:
    loaded back it computes the source's logits exactly and generates its greedy tokens, with
    the cache and without; off the zero init the routing changes the logits. The folder holds
    the experts' weights under the source's own names (what vLLM and other tools read), not as
    the fused tensors ``transformers`` keeps in memory."""
    from safetensors import safe_open

    src = source_model(kind)
    src.save_pretrained(tmp_path / "src")
    byte_tokenizer().save_pretrained(tmp_path / "src")
    from attnres.cli import main

    assert main(["convert", str(tmp_path / "src"), str(tmp_path / "dst"), "--heads", "4", "--block-layers", "1,3"]) in (0, None)
    with safe_open(tmp_path / "dst" / "model.safetensors", "pt") as saved, \
            safe_open(tmp_path / "src" / "model.safetensors", "pt") as source:
        assert set(saved.keys()) - set(source.keys()) == {n for n in saved.keys() if n.startswith("routing.")}
    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "dst")).eval()
    assert type(loaded).__name__ == f"AttnRes{type(src).__name__}"
    assert loaded.routing.block_sizes == (2, 6)
    x = ids()
    assert torch.equal(loaded(input_ids=x).logits, src(input_ids=x).logits)
    prompt = ids(b=1, t=6)
    expected = src.generate(prompt, max_new_tokens=10, do_sample=False)
    assert torch.equal(loaded.generate(prompt, max_new_tokens=10, do_sample=False), expected)
    assert torch.equal(loaded.generate(prompt, max_new_tokens=10, do_sample=False, use_cache=False), expected)
    with torch.no_grad():
        loaded.routing.gates.fill_(0.5)
        loaded.routing.pseudo_queries.normal_(generator=torch.Generator().manual_seed(0))
    assert (loaded(input_ids=x).logits - src(input_ids=x).logits).abs().max() > 1e-3


def test_a_native_moe_model_round_trips_with_its_balance_bias(tmp_path):
    torch.manual_seed(0)
    mc = ModelConfig(vocab_size=256, dim=32, n_layers=2, n_heads=2, residual="block", num_blocks=2, max_seq_len=64,
                     moe_experts=4, moe_balance="bias")
    model = AttnResForCausalLM(AttnResConfig.from_model_config(mc)).eval()
    with torch.no_grad():  # a bias that changes which experts are chosen: it must travel with the weights
        model.model.layers[0].mlp.expert_bias.copy_(torch.tensor([0.1, -0.2, 0.3, 0.0]))
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path)).eval()
    assert torch.equal(loaded.model.layers[0].mlp.expert_bias, model.model.layers[0].mlp.expert_bias)
    x = ids(b=1, t=10)
    assert torch.equal(loaded(input_ids=x).logits, model(input_ids=x).logits)
    assert torch.equal(loaded.generate(x, max_new_tokens=8, do_sample=False), model.model.generate(x, 8))


def decoding_models():
    """A native Block AttnRes model and a converted Llama, both off the zero init (live routing)."""
    torch.manual_seed(0)
    mc = ModelConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, residual="block",
                     num_blocks=2, heads=2, max_seq_len=128)
    native = AttnResForCausalLM(AttnResConfig.from_model_config(mc)).eval()
    converted = convert(source_model("llama"), heads=4, block_layers=[1, 3])
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        native.model.stream.pseudo_queries.normal_(generator=g)
        converted.routing.gates.fill_(0.5)
        converted.routing.pseudo_queries.normal_(generator=g)
    return {"native": (native, native.model.stream), "converted": (converted, converted.routing)}


@pytest.mark.parametrize("name", ["native", "converted"])
def test_the_hf_classes_decode_when_they_continue_from_a_cache(name, monkeypatch):
    """A pass that continues from a cache holding earlier tokens, with autograd off, is a decode
    pass (the stream's decoder runs it, one position or several); the prompt's pass and any pass
    with autograd on are ordinary ones. Every one gives the logits of the whole sequence's
    ordinary forward, and ``generate`` asks for one decode pass per token fed back."""
    from attnres.streams import Decoder

    model, stream = decoding_models()[name]
    made, real = [], stream.decoder

    def decoder(like):  # the real one, each call's result kept
        made.append(real(like))
        return made[-1]

    monkeypatch.setattr(stream, "decoder", decoder)
    x = ids(b=2, t=10)
    with torch.no_grad():
        full = model(input_ids=x).logits
        out = model(input_ids=x[:, :4], use_cache=True)
        assert made == []  # the prompt: an ordinary pass
        parts = [out.logits]
        for chunk in (x[:, 4:5], x[:, 5:8]):  # one position, then several
            out = model(input_ids=chunk, cache=out.cache, use_cache=True)
            parts.append(out.logits)
        assert len(made) == 2 and all(isinstance(d, Decoder) for d in made)
    out = model(input_ids=x[:, 8:], cache=out.cache, use_cache=True)  # autograd on: ordinary
    parts.append(out.logits.detach())
    assert len(made) == 2
    torch.testing.assert_close(torch.cat(parts, 1), full, atol=1e-5, rtol=1e-5)
    made.clear()
    generated = model.generate(ids(b=1, t=5), max_new_tokens=6, do_sample=False)
    assert len(made) == 5 and all(isinstance(d, Decoder) for d in made)
    assert torch.equal(generated, model.generate(ids(b=1, t=5), max_new_tokens=6, do_sample=False, use_cache=False))
