"""The Python API refuses what would give NaN or fail deep inside: epsilons that are not finite
and positive, sizes that are zero or booleans, integer embeddings, empty sequences; each error
names the argument."""

import pytest
import torch

from attnres import ModelConfig, Transformer, build_stream

SIZES = dict(vocab_size=64, dim=32, n_layers=2, n_heads=2)


@pytest.mark.parametrize("eps", [-1.0, 0.0, float("nan"), float("inf"), True])
def test_build_stream_refuses_an_epsilon_that_is_not_finite_and_positive(eps):
    with pytest.raises(ValueError, match=r"eps=.* must be a finite number > 0"):
        build_stream("block", dim=32, num_sublayers=4, eps=eps)


@pytest.mark.parametrize("field,value,message", [
    ("norm_eps", -1.0, r"norm_eps=-1.0 must be a finite number > 0"),
    ("norm_eps", float("nan"), r"norm_eps=nan must be a finite number > 0"),
    ("init_std", 0.0, r"init_std=0.0 must be a finite number > 0"),
    ("rope_theta", float("inf"), r"rope_theta=inf must be a finite number > 0"),
    ("ffn_dim", 0, r"ffn_dim=0 must be a positive integer"),
    ("n_layers", True, r"n_layers=True must be a positive integer"),
    ("dim", 32.0, r"dim=32.0 must be a positive integer"),
    ("n_kv_heads", True, r"n_kv_heads=True must be a positive integer"),
])
def test_model_config_refuses_values_that_would_fail_later(field, value, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig(**{**SIZES, field: value})


def test_a_stream_refuses_an_integer_embedding_naming_it():
    stream = build_stream("full", dim=32, num_sublayers=4)
    with pytest.raises(ValueError, match=r"init\(e\): e is a torch.int64 tensor \(2, 5, 32\)"):
        stream.init(torch.ones(2, 5, 32, dtype=torch.long))


@pytest.mark.parametrize("shape", [(2, 0), (0, 5)])
def test_an_empty_sequence_is_refused_naming_its_shape(shape):
    model = Transformer(ModelConfig(**SIZES))
    with pytest.raises(ValueError, match=rf"tokens \({shape[0]}, {shape[1]}\): an empty batch or sequence"):
        model(torch.ones(*shape, dtype=torch.long))
