"""Which tests the quick tier leaves to the full run.

The README's quick command (``-m "not slow"``) is a developer's check of
every code path; the full run (CI's) is every test. Besides the tests marked
``slow`` where they are written, three rules, applied by tests/conftest.py,
move repetitions of a path the quick tier already covers to the full run:

* a parametrization that names a measure outside :data:`QUICK_MEASURES`:
  those four cover each kind of statistic the library computes (moments,
  an absolute deviation, the extremes, a quantile selection with its
  superquantile), and the other measures reuse their code;
* a parametrization of the selection dispatch's tests that names a method
  outside :data:`QUICK_METHODS`;
* the parametrizations of a function in :data:`THOROUGH` outside its kept
  ids: a sweep over shapes, sizes or settings whose every case runs the
  same code, or a training run that another quick test already makes.
"""

from __future__ import annotations

from collections.abc import Mapping
import fnmatch

#: Measures every measure-parametrized test runs on in the quick tier.
QUICK_MEASURES = frozenset({"sd", "mad", "rbd", "sqd2"})

#: Selection methods every method-parametrized test of the selection
#: dispatch runs on in the quick tier: the default, the CPU kernel's and the
#: accelerators' code paths (which the CPU runs too).
QUICK_METHODS = frozenset({"adaptive", "native", "accelerator", "bracket"})

#: Selection method names; an id part naming one outside QUICK_METHODS, in
#: the dispatch's tests, goes to the full run.
ALL_METHODS = frozenset(
    {"adaptive", "native", "accelerator", "bracket", "bisect", "sort",
     "pallas_experimental"}
)  # fmt: skip
METHOD_TESTS = "tests/gbn_jax/selection/test_dispatch.py::"

#: Registered measure names; a parametrization id part equal to one of
#: these outside QUICK_MEASURES goes to the full run.
ALL_MEASURES = frozenset(
    {"sd", "mad", "rsd", "sqd", "sqd1", "sqd2", "sqd3", "rbd", "wcd", "bpoe"}
)

#: ``path::function`` -> fnmatch patterns of the parametrization ids the
#: quick tier keeps (an empty tuple: none, the whole function is thorough).
THOROUGH: Mapping[str, tuple[str, ...]] = {
    # Transforms of the layer: each transform once per kind of measure
    # quick, every combination in the full run.
    "tests/gbn_jax/test_layer_transforms.py::test_forward_mode_equals_reverse_mode": (
        "sqd2-one_device",
        "sqd2-axis_name",
        "sqd2-mask",
        "rbd-one_device",
    ),
    "tests/gbn_jax/test_layer_transforms.py::test_hessian": ("sqd2", "rbd"),
    "tests/gbn_jax/test_layer_transforms.py::test_forward_mode_half_precision": (
        "sqd2*",
    ),
    "tests/gbn_jax/test_layer_transforms.py::test_jit_and_grad_equal_eager": (
        "sd",
        "sqd2",
    ),
    "tests/gbn_jax/test_layer_transforms.py::test_vmap_over_stacked_models": (
        "sqd2",
    ),
    "tests/gbn_jax/test_layer_transforms.py::test_export_of_derivatives": (
        "sqd2",
    ),
    "tests/gbn_jax/test_layer_nested_trace.py::test_nested_renorm_stack_is_the_inline_program_bit_for_bit": (
        "sqd2",
    ),
    # Kernel passes and selection: every width, size, input kind and method
    # (quick: each method once, the default and the CPU kernel's on more).
    "tests/gbn_jax/selection/test_dispatch.py::test_axes": ("shape0-*",),
    "tests/gbn_jax/selection/test_dispatch.py::test_tiny_batches": ("2-*",),
    "tests/gbn_jax/selection/test_dispatch.py::test_vmap": ("adaptive",),
    "tests/gbn_jax/selection/test_dispatch.py::test_broadcast_mask_and_empty_feature_gives_nan": (
        "adaptive",
        "native",
        "accelerator",
    ),
    "tests/gbn_jax/selection/test_dispatch.py::test_mask": (
        "adaptive",
        "native",
        "accelerator",
    ),
    "tests/gbn_jax/selection/test_dispatch.py::test_nhwc_matches_numpy": (
        "normal-*",
    ),
    "tests/gbn_jax/selection/test_dispatch.py::test_native_sums_for_the_superquantile": (
        "*-3.0",
    ),
    "tests/gbn_jax/selection/test_dispatch.py::test_native_sampled_bracket_path": (
        "*-3.0",
    ),
    "tests/gbn_jax/selection/test_dispatch.py::test_native_tie_counts": (
        "*-3000-3.0",
    ),
    "tests/gbn_jax/selection/test_dispatch.py::test_accelerator_code_paths_on_cpu": (
        "normal-*",
    ),
    "tests/gbn_jax/selection/test_radix_sums.py::test_tiny_batches": ("1",),
    "tests/gbn_jax/selection/test_pallas.py::TestExactness::test_row_counts_per_feature_k": (
        "1",
        "7",
        "1000",
    ),
    "tests/gbn_jax/selection/test_bracket.py::TestExactness::test_row_counts_per_feature_k": (
        "1",
        "7",
        "1000",
    ),
    "tests/gbn_jax/selection/test_bracket.py::test_shard_map_and_pmap_groups_on_four_host_devices": (),
    "tests/gbn_jax/selection/test_radix.py::test_dispatch_through_kth_smallest_and_the_quantile_layers": (
        "False",
    ),
    "tests/gbn_jax/selection/test_native_hardening.py::test_subprocess_allocation_failure_raises": (
        "two_valued",
    ),
    "tests/gbn_jax/selection/test_native_hardening.py::test_subprocess_peak_memory_on_atoms": (
        "two_valued-*",
    ),
    "tests/gbn_jax/selection/test_native_hardening.py::test_kernel_bracket_over_two_atoms_uses_histogram_passes": (
        "1",
        "19",
    ),
    "tests/gbn_jax/test_quantiles.py::test_whole_alpha_n_selects_that_rank": (
        "*-1",
        "*-20",
    ),
    "tests/gbn_jax/test_quantiles.py::test_gradient_matches_finite_differences": (
        "0.3-*",
        "0.05-*",
    ),
    "tests/gbn_jax/selection/test_pallas_passes.py::test_values_counts_and_sums_equal_the_definition": (
        "True-37-4",
        "False-3-8",
    ),
    "tests/gbn_jax/selection/test_pallas.py::test_digit_widths_and_blocks_with_padding": (
        "8-64-2",
    ),
    "tests/gbn_jax/selection/test_radix_sums.py::test_values_and_gradients_match_definitions": (
        "masked",
    ),
    # Half precision: the quantile at each rank kind and dtype, quick at the
    # median.
    "tests/gbn_jax/test_quantiles_low_precision_grads.py::test_linen_gradients": (
        "sqd2-bfloat16-*",
    ),
    # The extremes' tie counts: quick on one layout of each count's path
    # (int32 over many per-example positions, float over the batch).
    "tests/gbn_jax/test_extreme_ties.py::test_value_grad_and_jvp": (
        "True-*-shape0-axes0",
        "False-*-shape3-axes3",
    ),
    "tests/gbn_jax/test_extreme_ties.py::test_hessian_vector_product": (
        "True-shape0-axes0",
        "False-shape3-axes3",
    ),
    "tests/gbn_jax/test_quantiles_low_precision_grads.py::test_measure_jvp_and_vjp": (
        "sqd2-*",
        "rbd-*",
    ),
    # abs's derivative: every distribution, shape and axis.
    "tests/gbn_jax/test_mad_derivative.py::test_value_grad_and_jvp_match_abs": (
        "*-shape0-0-False",
    ),
    "tests/gbn_jax/test_mad_derivative.py::test_second_order_matches_abs": (
        "shape0-0",
    ),
    # Per-layer comparisons repeated across settings and models.
    "tests/gbn_jax/test_group_layer_instance_norm.py::test_sd_is_flax_in_half_precision": (
        "group",
    ),
    "tests/gbn_jax/test_linen.py::test_fused_backward_equals_autodiff": (
        "sd*",
        "sqd2*",
    ),
    "tests/gbn_jax/test_calibration.py::test_off_is_bit_identical_to_the_module_without_the_option": (
        "sqd2*",
    ),
    "tests/gbn_jax/test_export_symbolic.py::test_every_measure_exports_with_symbolic_reduced_dims": (
        "batch",
    ),
    "tests/gbn_jax/test_convert_family.py::test_linen_lm1b_rsd_each_layernorm_is_numpy": (),
    "tests/gbn_jax/test_convert_family.py::test_nnx_sd_is_the_original": (
        "GroupNorm",
    ),
    "tests/gbn_jax/test_nnx.py::test_sd_is_nnx_batchnorm": ("{}",),
    "tests/gbn_jax/test_precise.py::test_equals_numpy_average_of_batch_statistics": (
        "0.9",
    ),
    "tests/gbn_jax/test_precise.py::test_backed_out_statistic_is_the_layers_own_to_float32_rounding": (
        "0.9",
    ),
    "tests/gbn_jax/test_calibration.py::test_gradient_is_the_raw_one_over_the_constant": (
        "*-True",
    ),
    "tests/gbn_jax/test_calibration.py::test_module_equals_its_definition": (
        "*-True",
    ),
    "tests/gbn_jax/test_layer_flax_compat.py::test_linen_complex_sd_equals_flax": (
        "False-False",
        "True-True",
    ),
    "tests/gbn_jax/test_export_symbolic.py::test_train_step_gradients_with_a_symbolic_batch": (
        "True",
    ),
    "tests/gbn_jax/test_convert.py::test_linen_sqd2_trains": (),
    # Training: the CLI end to end, resume and the curvature tool stay quick;
    # these repeat a run with one more setting.
    "tests/train/model/test_norms.py::test_gn_is_flax_group_norm": ("lenet-*",),
    "tests/train/model/test_models.py::test_patch_conv_equals_flax_conv": (
        "shape0-*",
    ),
    "tests/train/model/test_models.py::test_resnet_conv_equals_flax_conv": (
        "shape0-*",
    ),
    "tests/train/model/test_models.py::test_im2col_same_and_strided_is_the_convolution": (
        "shape0-*",
    ),
    "tests/train/model/test_models.py::test_lenet_conv_as_matmul_is_the_same_model": (
        "bn",
    ),
    "tests/benchmarks/step/test_bench_resnet_step.py::test_formulations_are_flax_conv": (
        "*-1",
    ),
    "tests/train/model/test_models.py::test_sd_norm_equals_flax_batchnorm": (
        "lenet",
    ),
    "tests/train/model/test_norms.py::test_gn_sd_equals_gn": (),
    "tests/train/data/test_subset.py::test_training_and_config_follow_the_subset": (),
    "tests/train/model/test_models.py::test_recompute_elementwise_is_the_same_layer": (
        "bn",
        "rbd",
    ),
    "tests/train/loop/test_trainer.py::test_steps_trains_exactly_n_steps_and_resumes_to_n": (
        "mad",
    ),
    "tests/train/loop/test_trainer.py::test_program_cache_is_keyed_by_the_selection_config_in_scope": (),
    "tests/train/loop/test_keep_checkpoints.py::test_curvature_measures_each_kept_checkpoint": (),
    "tests/train/data/test_subset.py::test_curvature_samples_the_runs_subset": (),
    "tests/train/native/test_convolution.py::test_every_instruction_set_gives_the_same_bits": (),
    "tests/train/model/test_activations.py::test_report_draws_activations": (),
    "tests/train/test_precise_stats_flag.py::test_train_loop_precise_evaluation_equals_numpy_statistics": (),
    "tests/train/test_calibration_flag.py::test_training_with_calibration": (),
    "tests/train/test_gain.py::test_gains_equal_numpy_at_init_and_after_training": (),
    "tests/train/loop/test_health.py::test_epoch_loop_says_it_once": (),
    "tests/train/report/test_batch_size.py::test_report_is_byte_identical_when_written_twice": (),
}


def _id_parts(param_id: str) -> set[str]:
  return set(param_id.split("-"))


def is_thorough(nodeid: str) -> bool:
  """Whether the quick tier leaves the test ``nodeid`` to the full run.

  Args:
    nodeid: pytest's node id, ``path::function[param-ids]``, the path
      relative to the repository root.

  Returns:
    True for a parametrization naming a measure outside
    :data:`QUICK_MEASURES` (or, in the dispatch's tests, a method outside
    :data:`QUICK_METHODS`), or one of a :data:`THOROUGH` function outside
    its kept ids.
  """
  function, _, rest = nodeid.partition("[")
  param_id = rest[:-1] if rest.endswith("]") else rest
  parts = _id_parts(param_id) if param_id else set()
  if parts & (ALL_MEASURES - QUICK_MEASURES):
    return True
  if nodeid.startswith(METHOD_TESTS) and parts & (ALL_METHODS - QUICK_METHODS):
    return True
  if function not in THOROUGH:
    return False
  if not param_id:
    return not THOROUGH[function]
  return not any(fnmatch.fnmatchcase(param_id, p) for p in THOROUGH[function])
