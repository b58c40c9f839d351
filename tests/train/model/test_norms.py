"""train.model.norms: the CLI's norm names go through the library's parser.

The parser itself (``gbn_jax.parse_measure_name``) is tested in
tests/gbn_jax/test_measures_capabilities.py.
"""

from train.model import norms


def test_training_cli_uses_the_parser(monkeypatch):
  seen = []
  real = norms.parse_measure_name
  monkeypatch.setattr(
      norms, "parse_measure_name", lambda t: seen.append(t) or real(t)
  )
  assert norms.parse_norm("sqd:0.4") == norms.NormSpec("sqd", 0.4)
  assert seen == ["sqd:0.4"]
