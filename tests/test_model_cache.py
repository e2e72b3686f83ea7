"""The default model's cache: the GGUF is read once, later loads read a Hugging Face folder and get the same model."""

from __future__ import annotations

import logging

import pytest
import torch

from lightning_nb.models import default as default_module
from lightning_nb.models.default import (IM_END, _load_cached_model, _write_cached_model, default_model_cache_dir,
                                         load_default_model)
from lightning_nb.errors import ConfigError

TEXTS = ["What is 17 + 25? Answer with a number.", "  two  spaces , before punctuation ! \n\n<|im_end|>x",
         "CALC: 3 * 12 - 7 = 29", "Ünïcödé 日本語 🙂 tabs\tand\r\nCRLF"]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"}, {"role": "user", "content": "2 + 2?"}]


def _one_token_logits(model) -> list[torch.Tensor]:
    """Logits of one-token forwards (as decoding runs them): their CPU kernels round by memory alignment."""
    with torch.no_grad():
        return [model(torch.tensor([[t]])).logits for t in (1, 9038, 30000)]


def test_the_cached_model_is_the_gguf_model(tmp_path, monkeypatch):
    written = []  # the model the first load read from the GGUF, as it was written to the cache

    def write(model, tokenizer, folder):
        written.append((model, tokenizer))
        return _write_cached_model(model, tokenizer, folder)

    monkeypatch.setattr(default_module, "_write_cached_model", write)
    first, tok_first = load_default_model(cache=tmp_path)  # reads the GGUF, writes the cache, reads it back
    (folder,) = [p for p in tmp_path.iterdir()]
    assert folder.name.startswith("SmolLM2-135M-Instruct-") and (folder / "model.safetensors").is_file()
    ((from_gguf, tok_gguf),) = written
    assert from_gguf.name_or_path != str(folder)
    cached, tok_cached = load_default_model(cache=tmp_path)  # reads the folder only
    assert len(written) == 1 and cached.name_or_path == first.name_or_path == str(folder)
    # the first load computes as later loads do, to the last bit (the GGUF's own tensors did not: a
    # one-token forward differed in the last bits on AVX-512, and a resumed run then diverged)
    assert all(torch.equal(a, b) for a, b in zip(_one_token_logits(first), _one_token_logits(cached)))
    assert tok_first.eos_token == tok_first.pad_token == IM_END and first.generation_config.eos_token_id == 2

    gguf_state, cached_state = from_gguf.state_dict(), cached.state_dict()
    assert list(gguf_state) == list(cached_state)
    assert all(torch.equal(gguf_state[k], cached_state[k]) for k in gguf_state)
    assert cached.lm_head.weight is cached.model.embed_tokens.weight  # tied, as from the GGUF
    assert cached.generation_config.eos_token_id == cached.generation_config.pad_token_id == 2

    assert tok_cached.backend_tokenizer.to_str() == tok_gguf.backend_tokenizer.to_str()
    assert [tok_cached(t).input_ids for t in TEXTS] == [tok_gguf(t).input_ids for t in TEXTS]
    ids = list(range(0, 49152, 61))
    assert tok_cached.decode(ids) == tok_gguf.decode(ids)
    assert tok_cached.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True) == \
        tok_gguf.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert tok_cached.eos_token == tok_cached.pad_token == IM_END and tok_cached.clean_up_tokenization_spaces is False
    assert [p.name for p in tmp_path.iterdir()] == [folder.name]  # no temporary folder left


def test_a_damaged_cache_is_dropped_and_an_unwritable_one_only_warns(engine, tmp_path, caplog):
    folder = tmp_path / "damaged"
    _write_cached_model(engine.model, engine.tokenizer, folder)
    assert (folder / "model.safetensors").is_file()
    (folder / "model.safetensors").write_bytes(b"not safetensors")
    with caplog.at_level(logging.WARNING, logger="lightning_nb.models.default"):
        assert _load_cached_model(folder) is None
    assert "reading the GGUF again" in caplog.text and not folder.exists()

    blocker = tmp_path / "a_file"
    blocker.write_text("")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="lightning_nb.models.default"):
        _write_cached_model(engine.model, engine.tokenizer, blocker / "model")  # the parent is a file
    assert "could not cache the default model" in caplog.text and "cache=False" in caplog.text


def test_cache_location_and_bad_values(monkeypatch, tmp_path):
    monkeypatch.setenv("LIGHTNING_NB_CACHE_DIR", str(tmp_path / "c"))
    assert default_model_cache_dir() == tmp_path / "c"
    monkeypatch.delenv("LIGHTNING_NB_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_model_cache_dir() == tmp_path / "xdg" / "lightning_nb"
    with pytest.raises(ConfigError, match="cache must be"):
        load_default_model(cache=1)
