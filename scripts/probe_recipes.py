"""Hand-written probe arguments for registry functions whose parameters cannot be guessed by name.

``RECIPES[name]()`` returns ``(args, kwargs)`` for one real call on small CPU tensors.  ``SKIP`` names
functions that must not be called in a probe at all, with the reason.
"""

from __future__ import annotations

import torch


def _m(*shape, dtype=torch.float32):
    """A small deterministic tensor (default: a well-conditioned 3x3 matrix)."""
    shape = shape or (3, 3)
    g = torch.Generator().manual_seed(0)
    t = torch.rand(*shape, generator=g) + 0.5
    if len(shape) >= 2 and shape[-1] == shape[-2]:
        t = t * 0.1 + torch.eye(shape[-1]) * 2
    return t.to(dtype)


def _v(n=3):
    return torch.arange(1.0, n + 1)


def _coo():
    return torch.eye(3).to_sparse()


def _q():
    return torch.quantize_per_tensor(_m(), 0.1, 0, torch.quint8)


def _qc():
    return torch.quantize_per_channel(_m(), torch.tensor([0.1, 0.2, 0.3]), torch.zeros(3, dtype=torch.long), 0,
                                      torch.quint8)


def _lu():
    LU, pivots = torch.linalg.lu_factor(_m())
    return LU, pivots


def _rnn_params(gates, hidden=3, inp=3):
    return [_m(gates * hidden, inp), _m(gates * hidden, hidden), _v(gates * hidden), _v(gates * hidden)]


def _geqrf():
    return torch.geqrf(_m())


def _mha():
    q = _m(2, 1, 4)
    return ((q, q, q, 4, 2, _m(12, 4), _v(12), None, None, False, 0.0, _m(4, 4), _v(4)), {"training": False})


_R = {
    # ----- Python-level dunders and conversions
    "torch.Tensor.__array__": lambda: ((_m(),), {}),
    "torch.Tensor.__array_wrap__": lambda: ((_m(), _m().numpy()), {}),
    "torch.Tensor.__deepcopy__": lambda: ((_m(), {}), {}),
    "torch.Tensor.__format__": lambda: ((torch.tensor(1.5), ""), {}),
    "torch.Tensor.__index__": lambda: ((torch.tensor(1),), {}),
    "torch.Tensor.__reduce_ex__": lambda: ((_m(), 2), {}),
    "torch.Tensor.__setitem__": lambda: ((_m(), 0, 1.0), {}),
    "torch.Tensor.__setstate__": lambda: ((_m(), (torch.zeros(3).untyped_storage(), 0, (3,), (1,), False, None)), {}),
    "torch.Tensor._autocast_to_full_precision": lambda: ((_m(), False, True), {}),
    "torch.Tensor._autocast_to_reduced_precision": lambda: ((_m(), False, True, torch.float16, torch.bfloat16), {}),
    "torch.Tensor.apply_": lambda: ((_m(), lambda v: v * 2), {}),
    "torch.Tensor.map_": lambda: ((_m(), _m(), lambda a, b: a + b), {}),
    "torch.Tensor.map2_": lambda: ((_m(), _m(), _m(), lambda a, b, c: a + b + c), {}),
    "torch.Tensor.backward": lambda: ((_m().requires_grad_().sum(),), {}),
    "torch.Tensor.register_hook": lambda: ((_m().requires_grad_(), lambda g: g), {}),
    "torch.Tensor.register_post_accumulate_grad_hook": lambda: ((_m().requires_grad_(), lambda t: None), {}),
    "torch.Tensor.retain_grad": lambda: ((_m().requires_grad_() * 1,), {}),
    "torch.Tensor.set_": lambda: ((_m(), _m()), {}),
    # ----- shapes the name does not reveal
    "torch.Tensor.addbmm": lambda: ((_m(), _m(2, 3, 3), _m(2, 3, 3)), {}),
    "torch.Tensor.addbmm_": lambda: ((_m(), _m(2, 3, 3), _m(2, 3, 3)), {}),
    "torch.addbmm": lambda: ((_m(), _m(2, 3, 3), _m(2, 3, 3)), {}),
    "torch.Tensor.addmv": lambda: ((_v(), _m(), _v()), {}),
    "torch.Tensor.addmv_": lambda: ((_v(), _m(), _v()), {}),
    "torch.addmv": lambda: ((_v(), _m(), _v()), {}),
    "torch.Tensor.addr_": lambda: ((_m(), _v(), _v()), {}),
    "torch.Tensor.mv": lambda: ((_m(), _v()), {}),
    "torch.mv": lambda: ((_m(), _v()), {}),
    "torch.Tensor.as_strided": lambda: ((_m(), (2, 2), (1, 1)), {}),
    "torch.Tensor.as_strided_": lambda: ((_m(), (2, 2), (1, 1)), {}),
    "torch.as_strided_copy": lambda: ((_m(), (2, 2), (1, 1)), {}),
    "torch.Tensor.as_strided_scatter": lambda: ((_m(), _m(2, 2), (2, 2), (1, 1)), {}),
    "torch.as_strided_scatter": lambda: ((_m(), _m(2, 2), (2, 2), (1, 1)), {}),
    "torch.Tensor.clamp": lambda: ((_m(), 0.0, 1.0), {}),
    "torch.Tensor.clamp_": lambda: ((_m(), 0.0, 1.0), {}),
    "torch.Tensor.clip": lambda: ((_m(), 0.0, 1.0), {}),
    "torch.Tensor.clip_": lambda: ((_m(), 0.0, 1.0), {}),
    "torch.clamp": lambda: ((_m(), 0.0, 1.0), {}),
    "torch.clip": lambda: ((_m(), 0.0, 1.0), {}),
    "torch.Tensor.diagonal_scatter": lambda: ((_m(), _v()), {}),
    "torch.diagonal_scatter": lambda: ((_m(), _v()), {}),
    "torch.Tensor.select_scatter": lambda: ((_m(), _v(), 0, 0), {}),
    "torch.select_scatter": lambda: ((_m(), _v(), 0, 0), {}),
    "torch.Tensor.float_power_": lambda: ((_m(dtype=torch.float64), 2), {}),
    "torch.Tensor.index": lambda: ((_m(), (torch.tensor([0, 1]),)), {}),
    "torch.Tensor.index_reduce": lambda: ((_m(), 0, torch.tensor([0, 1, 0]), _m(), "prod"), {}),
    "torch.Tensor.index_reduce_": lambda: ((_m(), 0, torch.tensor([0, 1, 0]), _m(), "prod"), {}),
    "torch.index_reduce": lambda: ((_m(), 0, torch.tensor([0, 1, 0]), _m(), "prod"), {}),
    "torch.Tensor.logsumexp": lambda: ((_m(), 0), {}),
    "torch.logsumexp": lambda: ((_m(), 0), {}),
    "torch.Tensor.nonzero_static": lambda: ((_m(),), {"size": 4}),
    "torch.nonzero_static": lambda: ((_m(),), {"size": 4}),
    "torch.permute": lambda: ((_m(), (1, 0)), {}),
    "torch.polygamma": lambda: ((1, _m()), {}),
    "torch.special.polygamma": lambda: ((1, _m()), {}),
    "torch.Tensor.repeat_interleave": lambda: ((_m(), 2), {}),
    "torch.Tensor.scatter": lambda: ((_m(), 0, torch.zeros(3, 3, dtype=torch.long), _m()), {}),
    "torch.Tensor.scatter_": lambda: ((_m(), 0, torch.zeros(3, 3, dtype=torch.long), _m()), {}),
    "torch.scatter": lambda: ((_m(), 0, torch.zeros(3, 3, dtype=torch.long), _m()), {}),
    "torch.Tensor.split_with_sizes": lambda: ((_m(), [1, 2]), {}),
    "torch.split_with_sizes": lambda: ((_m(), [1, 2]), {}),
    "torch.Tensor.unsafe_split_with_sizes": lambda: ((_m(), [1, 2]), {}),
    "torch.unsafe_split_with_sizes": lambda: ((_m(), [1, 2]), {}),
    "torch.Tensor.tile": lambda: ((_m(), (2,)), {}),
    "torch.Tensor.where": lambda: ((_m(), _m() > 1, _m()), {}),
    "torch.view_as_complex": lambda: ((_m(3, 2),), {}),
    "torch.view_as_complex_copy": lambda: ((_m(3, 2),), {}),
    "torch.unflatten": lambda: ((_m(), 1, (3, 1)), {}),
    "torch.binomial": lambda: ((torch.full((3,), 5.0), torch.full((3,), 0.5)), {}),
    "torch.block_diag": lambda: ((_m(), _m()), {}),
    "torch.functional.block_diag": lambda: ((_m(), _m()), {}),
    "torch.broadcast_tensors": lambda: ((_m(), _v()), {}),
    "torch.functional.broadcast_tensors": lambda: ((_m(), _v()), {}),
    "torch.cartesian_prod": lambda: ((_v(), _v()), {}),
    "torch.functional.cartesian_prod": lambda: ((_v(), _v()), {}),
    "torch.einsum": lambda: (("ij,jk->ik", _m(), _m()), {}),
    "torch.functional.einsum": lambda: (("ij,jk->ik", _m(), _m()), {}),
    "torch.frobenius_norm": lambda: ((_m(), (0, 1)), {}),
    "torch.histogramdd": lambda: ((_m(4, 2), [2, 2]), {}),
    "torch.stft": lambda: ((_v(16), 8), {"return_complex": True}),
    "torch.functional.stft": lambda: ((_v(16), 8), {"return_complex": True}),
    "torch.Tensor.stft": lambda: ((_v(16), 8), {"return_complex": True}),
    "torch.istft": lambda: ((torch.stft(_v(16), 8, window=torch.hann_window(8), return_complex=True), 8),
                            {"window": torch.hann_window(8)}),
    "torch.functional.istft": lambda: ((torch.stft(_v(16), 8, window=torch.hann_window(8), return_complex=True), 8),
                                       {"window": torch.hann_window(8)}),
    "torch.Tensor.istft": lambda: ((torch.stft(_v(16), 8, window=torch.hann_window(8), return_complex=True), 8),
                                   {"window": torch.hann_window(8)}),
    # ----- linear algebra with factorization inputs
    "torch.Tensor.lu_solve": lambda: ((_m(), *_lu()), {}),
    "torch.lu_solve": lambda: ((_m(), *_lu()), {}),
    "torch.linalg.lu_solve": lambda: ((*_lu(), _m()), {}),
    "torch.lu_unpack": lambda: (_lu(), {}),
    "torch.Tensor.orgqr": lambda: (_geqrf(), {}),
    "torch.orgqr": lambda: (_geqrf(), {}),
    "torch.linalg.householder_product": lambda: (_geqrf(), {}),
    "torch.Tensor.ormqr": lambda: ((*_geqrf(), _m()), {}),
    "torch.ormqr": lambda: ((*_geqrf(), _m()), {}),
    "torch.linalg.ldl_solve": lambda: ((*torch.linalg.ldl_factor(_m()), _m()), {}),
    "torch.linalg.solve_triangular": lambda: ((torch.triu(_m()), _m()), {"upper": True}),
    "torch.linalg.tensorinv": lambda: ((_m(4, 4).reshape(4, 2, 2),), {"ind": 1}),
    # ----- sparse and quantized layouts (CPU kernels exist)
    "torch.Tensor._dimI": lambda: ((_coo(),), {}),
    "torch.Tensor._dimV": lambda: ((_coo(),), {}),
    "torch.Tensor._indices": lambda: ((_coo(),), {}),
    "torch.Tensor._values": lambda: ((_coo(),), {}),
    "torch.Tensor._nnz": lambda: ((_coo(),), {}),
    "torch.Tensor.coalesce": lambda: ((_coo(),), {}),
    "torch.Tensor._coalesced_": lambda: ((_coo(), True), {}),
    "torch.Tensor.is_coalesced": lambda: ((_coo(),), {}),
    "torch.Tensor.indices": lambda: ((_coo(),), {}),
    "torch.Tensor.values": lambda: ((_coo(),), {}),
    "torch.indices_copy": lambda: ((_coo(),), {}),
    "torch.values_copy": lambda: ((_coo(),), {}),
    "torch.Tensor._to_dense": lambda: ((_coo(),), {}),
    "torch.Tensor.crow_indices": lambda: ((torch.eye(3).to_sparse_csr(),), {}),
    "torch.Tensor.col_indices": lambda: ((torch.eye(3).to_sparse_csr(),), {}),
    "torch.crow_indices_copy": lambda: ((torch.eye(3).to_sparse_csr(),), {}),
    "torch.col_indices_copy": lambda: ((torch.eye(3).to_sparse_csr(),), {}),
    "torch.Tensor.ccol_indices": lambda: ((torch.eye(3).to_sparse_csc(),), {}),
    "torch.Tensor.row_indices": lambda: ((torch.eye(3).to_sparse_csc(),), {}),
    "torch.ccol_indices_copy": lambda: ((torch.eye(3).to_sparse_csc(),), {}),
    "torch.row_indices_copy": lambda: ((torch.eye(3).to_sparse_csc(),), {}),
    "torch.Tensor.sparse_mask": lambda: ((_m(), _coo()), {}),
    "torch.Tensor._sparse_mask_projection": lambda: ((_m(), _coo()), {}),
    "torch.Tensor.resize_as_sparse_": lambda: ((_coo(), _coo()), {}),
    "torch.Tensor.sparse_resize_": lambda: ((_coo(), (3, 3), 2, 0), {}),
    "torch.Tensor.sparse_resize_and_clear_": lambda: ((_coo(), (3, 3), 2, 0), {}),
    "torch.Tensor.smm": lambda: ((_coo(), _m()), {}),
    "torch.smm": lambda: ((_coo(), _m()), {}),
    "torch.Tensor.sspaddmm": lambda: ((_coo(), _coo(), _m()), {}),
    "torch.sspaddmm": lambda: ((_coo(), _coo(), _m()), {}),
    "torch.saddmm": lambda: ((_coo(), _coo(), _m()), {}),
    "torch.hspmm": lambda: ((_coo(), _m()), {}),
    "torch.hsmm": lambda: ((_coo(), _m()), {}),
    "torch.Tensor.int_repr": lambda: ((_q(),), {}),
    "torch.int_repr": lambda: ((_q(),), {}),
    "torch.Tensor.q_scale": lambda: ((_q(),), {}),
    "torch.q_scale": lambda: ((_q(),), {}),
    "torch.Tensor.q_zero_point": lambda: ((_q(),), {}),
    "torch.q_zero_point": lambda: ((_q(),), {}),
    "torch.Tensor.qscheme": lambda: ((_q(),), {}),
    "torch.Tensor.q_per_channel_axis": lambda: ((_qc(),), {}),
    "torch.q_per_channel_axis": lambda: ((_qc(),), {}),
    "torch.Tensor.q_per_channel_scales": lambda: ((_qc(),), {}),
    "torch.q_per_channel_scales": lambda: ((_qc(),), {}),
    "torch.Tensor.q_per_channel_zero_points": lambda: ((_qc(),), {}),
    "torch.q_per_channel_zero_points": lambda: ((_qc(),), {}),
    "torch.quantize_per_tensor": lambda: ((_m(), 0.1, 0, torch.quint8), {}),
    "torch.quantize_per_channel": lambda: ((_m(), torch.tensor([0.1, 0.2, 0.3]), torch.zeros(3, dtype=torch.long), 0,
                                            torch.quint8), {}),
    "torch.quantize_per_tensor_dynamic": lambda: ((_m(), torch.quint8, False), {}),
    "torch.quantized_max_pool1d": lambda: ((torch.quantize_per_tensor(_m(1, 3, 4), 0.1, 0, torch.quint8), [2]), {}),
    "torch.quantized_max_pool2d": lambda: ((torch.quantize_per_tensor(_m(1, 2, 4, 4), 0.1, 0, torch.quint8), [2, 2]),
                                           {}),
    "torch.quantized_max_pool3d": lambda: ((torch.quantize_per_tensor(_m(1, 2, 2, 4, 4), 0.1, 0, torch.quint8),
                                            [1, 2, 2]), {}),
    "torch.fake_quantize_per_channel_affine": lambda: ((_m(), torch.tensor([0.1, 0.2, 0.3]),
                                                        torch.zeros(3, dtype=torch.int32), 0, 0, 255), {}),
    "torch.fbgemm_linear_fp16_weight": lambda: ((_m(), torch.fbgemm_pack_gemm_matrix_fp16(_m()), _v()), {}),
    "torch.fbgemm_linear_fp16_weight_fp32_activation": lambda: ((_m(), torch.fbgemm_pack_gemm_matrix_fp16(_m()), _v()),
                                                                {}),
    "torch.choose_qparams_optimized": lambda: ((_m().flatten(), 9, 200, 0.16, 8), {}),
    "torch.native_norm": lambda: ((_coo(),), {}),
    # ----- nn kernels
    "torch.conv3d": lambda: ((_m(1, 2, 3, 3, 3), _m(1, 2, 1, 1, 1)), {}),
    "torch.nn.functional.conv3d": lambda: ((_m(1, 2, 3, 3, 3), _m(1, 2, 1, 1, 1)), {}),
    "torch.conv_tbc": lambda: ((_m(3, 1, 2), _m(1, 2, 2), _v(2)), {}),
    "torch.nn.functional.conv_tbc": lambda: ((_m(3, 1, 2), _m(1, 2, 2), _v(2)), {}),
    "torch.conv_transpose1d": lambda: ((_m(1, 2, 3), _m(2, 1, 1)), {}),
    "torch.nn.functional.conv_transpose1d": lambda: ((_m(1, 2, 3), _m(2, 1, 1)), {}),
    "torch.conv_transpose2d": lambda: ((_m(1, 2, 3, 3), _m(2, 1, 1, 1)), {}),
    "torch.nn.functional.conv_transpose2d": lambda: ((_m(1, 2, 3, 3), _m(2, 1, 1, 1)), {}),
    "torch.conv_transpose3d": lambda: ((_m(1, 2, 3, 3, 3), _m(2, 1, 1, 1, 1)), {}),
    "torch.nn.functional.conv_transpose3d": lambda: ((_m(1, 2, 3, 3, 3), _m(2, 1, 1, 1, 1)), {}),
    "torch.convolution": lambda: ((_m(1, 2, 3, 3), _m(1, 2, 1, 1), None, [1, 1], [0, 0], [1, 1], False, [0, 0], 1), {}),
    "torch.cosine_embedding_loss": lambda: ((_m(), _m(), torch.ones(3)), {}),
    "torch.nn.functional.cosine_embedding_loss": lambda: ((_m(), _m(), torch.ones(3)), {}),
    "torch.nn.functional.nll_loss": lambda: ((_m().log_softmax(1), torch.tensor([0, 1, 2])), {}),
    "torch.nn.functional.multi_margin_loss": lambda: ((_m(), torch.tensor([0, 1, 2])), {}),
    "torch.nn.functional.multilabel_margin_loss": lambda: ((_m(), torch.tensor([[0, -1, 1]] * 3)), {}),
    "torch.nn.functional.ctc_loss": lambda: ((_m(4, 1, 3).log_softmax(2), torch.tensor([[1, 2]]), [4], [2]), {}),
    "torch.ctc_loss": lambda: ((_m(4, 1, 3).log_softmax(2), torch.tensor([[1, 2]]), [4], [2]), {}),
    "torch.embedding_bag": lambda: ((_m(), torch.tensor([0, 1, 2]), torch.tensor([0, 2])), {}),
    "torch.nn.functional.embedding_bag": lambda: ((torch.tensor([0, 1, 2]), _m(), torch.tensor([0, 2])), {}),
    "torch.batch_norm": lambda: ((_m(2, 3), _v(), _v(), torch.zeros(3), torch.ones(3), False, 0.1, 1e-5, False), {}),
    "torch.nn.functional.batch_norm": lambda: ((_m(2, 3), torch.zeros(3), torch.ones(3)), {}),
    "torch.native_batch_norm": lambda: ((_m(2, 3), _v(), _v(), torch.zeros(3), torch.ones(3), False, 0.1, 1e-5), {}),
    "torch.batch_norm_update_stats": lambda: ((_m(2, 3), torch.zeros(3), torch.ones(3), 0.1), {}),
    "torch.instance_norm": lambda: ((_m(1, 3, 4), None, None, None, None, True, 0.1, 1e-5, False), {}),
    "torch.group_norm": lambda: ((_m(1, 4, 2), 2), {}),
    "torch.nn.functional.group_norm": lambda: ((_m(1, 4, 2), 2), {}),
    "torch.native_group_norm": lambda: ((_m(1, 4, 2), None, None, 1, 4, 2, 2, 1e-5), {}),
    "torch.native_layer_norm": lambda: ((_m(), (3,), None, None, 1e-5), {}),
    "torch.affine_grid_generator": lambda: ((_m(1, 2, 3), (1, 1, 2, 2), False), {}),
    "torch.nn.functional.affine_grid": lambda: ((_m(1, 2, 3), (1, 1, 2, 2)), {"align_corners": False}),
    "torch.grid_sampler": lambda: ((_m(1, 1, 3, 3), _m(1, 2, 2, 2) - 1, 0, 0, False), {}),
    "torch.grid_sampler_2d": lambda: ((_m(1, 1, 3, 3), _m(1, 2, 2, 2) - 1, 0, 0, False), {}),
    "torch.grid_sampler_3d": lambda: ((_m(1, 1, 3, 3, 3), _m(1, 2, 2, 2, 3) - 1, 0, 0, False), {}),
    "torch.nn.functional.grid_sample": lambda: ((_m(1, 1, 3, 3), _m(1, 2, 2, 2) - 1), {"align_corners": False}),
    "torch.nn.functional.fold": lambda: ((_m(1, 4, 4), (3, 3), 2), {}),
    "torch.nn.functional.fractional_max_pool2d": lambda: ((_m(1, 1, 4, 4), 2), {"output_size": 2}),
    "torch.nn.functional.fractional_max_pool2d_with_indices": lambda: ((_m(1, 1, 4, 4), 2), {"output_size": 2}),
    "torch.nn.functional.fractional_max_pool3d": lambda: ((_m(1, 1, 4, 4, 4), 2), {"output_size": 2}),
    "torch.nn.functional.fractional_max_pool3d_with_indices": lambda: ((_m(1, 1, 4, 4, 4), 2), {"output_size": 2}),
    "torch.nn.functional.interpolate": lambda: ((_m(1, 1, 2, 2),), {"scale_factor": 2}),
    "torch.nn.functional.max_unpool1d": lambda: ((_m(1, 1, 2), torch.tensor([[[0, 3]]]), 2), {}),
    "torch.nn.functional.max_unpool2d": lambda: ((_m(1, 1, 2, 2), torch.tensor([[[[0, 3], [8, 11]]]]), 2), {}),
    "torch.nn.functional.max_unpool3d": lambda: ((_m(1, 1, 1, 1, 1), torch.tensor([[[[[0]]]]]), 2), {}),
    "torch.nn.functional.multi_head_attention_forward": _mha,
    "torch.nn.functional.scaled_dot_product_attention": lambda: ((_m(1, 2, 3), _m(1, 2, 3), _m(1, 2, 3)), {}),
    "torch.poisson_nll_loss": lambda: ((_m(), _m(), True, False, 1e-8, 1), {}),
    "torch.gru_cell": lambda: ((_m(), _m(), *_rnn_params(3)), {}),
    "torch.lstm_cell": lambda: ((_m(), (_m(), _m()), *_rnn_params(4)), {}),
    "torch.gru": lambda: ((_m(2, 1, 3), _m(1, 1, 3), _rnn_params(3), True, 1, 0.0, False, False, False), {}),
    "torch.rnn_tanh": lambda: ((_m(2, 1, 3), _m(1, 1, 3), _rnn_params(1), True, 1, 0.0, False, False, False), {}),
    "torch.rnn_relu": lambda: ((_m(2, 1, 3), _m(1, 1, 3), _rnn_params(1), True, 1, 0.0, False, False, False), {}),
    "torch.lstm": lambda: ((_m(2, 1, 3), (_m(1, 1, 3), _m(1, 1, 3)), _rnn_params(4), True, 1, 0.0, False, False,
                            False), {}),
    "torch.Tensor._nested_tensor_size": lambda: ((torch.nested.nested_tensor([_m(2, 3), _m(1, 3)]),), {}),
    "torch.Tensor._nested_tensor_strides": lambda: ((torch.nested.nested_tensor([_m(2, 3), _m(1, 3)]),), {}),
    "torch.Tensor._nested_tensor_storage_offsets": lambda: ((torch.nested.nested_tensor([_m(2, 3), _m(1, 3)]),),
                                                           {}),
    "torch.Tensor._sparse_mask_projection": lambda: ((_m(), _coo()), {"accumulate_matches": False}),
    # ----- kept small so the probe run stays quick
    "torch.lobpcg": lambda: ((_m(4, 4),), {"k": 1, "niter": 2}),
    "torch.Tensor.dim_order": lambda: ((_m(),), {}),
    # ----- symbolic-shape helpers: plain Python numbers are their everyday input
    "torch.sym_max": lambda: ((1, 2), {}),
    "torch.sym_min": lambda: ((1, 2), {}),
    "torch.sym_ite": lambda: ((True, 1, 2), {}),
    "torch.sym_float": lambda: ((1,), {}),
    "torch.sym_int": lambda: ((1.5,), {}),
    "torch.sym_not": lambda: ((True,), {}),
    "torch._sym_sqrt": lambda: ((4.0,), {}),
}

RECIPES: dict = dict(_R)

SKIP: dict = {}
