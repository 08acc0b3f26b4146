"""Pure ``@triton.jit`` math: activations (the matmul epilogue's, selected by a
compile-time code) and the registry entries' math. Each function maps compute-dtype
values to values; loads, stores and casts live in the kernels.
"""

from __future__ import annotations

import triton
import triton.language as tl

from . import helpers

#: 1/sqrt(2), for the erf form of GELU.
SQRT_1_2 = tl.constexpr(0.7071067811865476)
#: sqrt(2/pi), for the tanh form of GELU.
SQRT_2_OVER_PI = tl.constexpr(0.7978845608028654)
#: Cubic coefficient of the tanh form of GELU.
GELU_TANH_CUBIC = tl.constexpr(0.044715)
#: Where ``0.5 (1 + tanh z)`` falls below this, PyTorch's float64 tanh-GELU derivative
#: (``0.5 (1 + t) + 0.5 v (1 - t^2) z'``, ``t = tanh z``) is exactly +0 (measured: ``t`` within an
#: ulp of -1); the true value there is below 1e-14 in magnitude. The same zero, and sign of
#: ``grad * 0``, here, in every dtype: results are checked against float64.
TANH_SATURATED = tl.constexpr(2.0**-54)
#: log2(e): ``exp(x) = 2^(x log2 e)``.
LOG2_E = tl.constexpr(1.4426950408889634)
#: 1/sqrt(2 pi), the standard normal density's factor (GELU's derivative).
INV_SQRT_2PI = tl.constexpr(0.3989422804014327)
#: GELU's erfc below float64: ``erfc(a) ~= t P(t) exp(-a^2)``, ``t = 1 / (1 + ERFC_P a)``, for
#: ``a >= 0`` (Abramowitz and Stegun's form 7.1.26, refitted here by weighted least squares
#: with a sixth coefficient, ``P(1)`` held at 1): |error| <= 4.5e-8 with float32 coefficients,
#: under float32's rounding of the result; relative error up to 1.6e-4 where erfc > 1e-6,
#: 1.7e-3 where it is > 1e-16. One approximate exp (shared with the derivative's density) and
#: reciprocal, where libdevice's erff costs about 30 instructions, 14 of them coefficient
#: selects: bfloat16 gelu_mul compiles to about 25 instructions an element for sm_90 against
#: 40 with erff, which held it at 88% of the copy roof at 2^28 elements on the H200.
ERFC_P = tl.constexpr(0.39)
#: ``P(t) = C1 + C2 t + ... + C6 t^5`` (``ERFC_P``).
ERFC_C1 = tl.constexpr(0.23529619)
ERFC_C2 = tl.constexpr(0.091568075)
ERFC_C3 = tl.constexpr(0.6491171)
ERFC_C4 = tl.constexpr(-0.63485897)
ERFC_C5 = tl.constexpr(0.88633496)
ERFC_C6 = tl.constexpr(-0.22745733)

#: Activation codes, the compile-time switch of kernels with an epilogue. Strings
#: map to them once, at the Python boundary (:data:`ACTIVATIONS`).
ACT_NONE = tl.constexpr(0)
ACT_RELU = tl.constexpr(1)
ACT_GELU = tl.constexpr(2)
ACT_GELU_TANH = tl.constexpr(3)
ACT_SILU = tl.constexpr(4)
ACTIVATIONS = {None: 0, "none": 0, "relu": 1, "gelu": 2, "gelu_tanh": 3, "silu": 4}


@triton.jit
def relu(v):
    """``max(v, 0)`` with PyTorch's special values: NaN stays NaN, -0.0 stays -0.0.

    Written as ``v < 0 ? 0 : v`` because ``v > 0 ? v : 0`` would turn NaN into 0.
    """
    return tl.where(v < 0, 0, v)


@triton.jit
def erfc_gauss(a):
    """``(erfc(a), exp(-a^2))`` for ``a >= 0`` below float64 (see ``ERFC_P``); NaN gives NaN,
    +inf gives zeros."""
    gauss = helpers.exp2_approx(-a * (a * LOG2_E))  # (flushed to 0 past a = 9.4: erfc(a) < 1e-39)
    # (a tensor first: in Triton 3.9's interpreter a constexpr times a tensor is a constexpr, which a
    # jit function refuses as its argument)
    t = helpers.reciprocal_approx(a * ERFC_P + 1)  # (0 for an infinite a)
    poly = ERFC_C1 + t * (ERFC_C2 + t * (ERFC_C3 + t * (ERFC_C4 + t * (ERFC_C5 + t * ERFC_C6))))
    return t * poly * gauss, gauss


@triton.jit
def normal_cdf2(v):
    """``(2 Phi(v), exp(-v^2 / 2))``: twice the standard normal CDF, ``1 + erf(v / sqrt 2)``,
    and the density's exponential. Below float64 the CDF comes from ``erfc(|v| / sqrt 2)``,
    which keeps relative accuracy where the CDF is small (float32: 1.4e-5 where |gelu| > 1e-3,
    7e-4 where it is > 1e-10), where ``1 + erf`` cancels (to 0 below v = -5.8 in float32).
    Rounded to float16 or bfloat16, GELU and its derivative are within an ulp of exact for
    every input whose result exceeds 2^-100 in magnitude (``tests/test_gates.py``)."""
    z = v * SQRT_1_2
    if v.dtype == tl.float64:
        cdf2 = 1 + tl.math.erf(z)
        gauss = tl.exp(-0.5 * v * v)
    else:
        tail, gauss = erfc_gauss(tl.abs(z))
        cdf2 = tl.where(z >= 0, 2 - tail, tail)
    return cdf2, gauss


@triton.jit
def sigmoid_exp(v):
    """``(sigmoid(v), exp(-v))``. Below float64 from the approximate exp2 and reciprocal
    (``helpers.exp2_approx``, ``helpers.reciprocal_approx``): two MUFU instructions where
    ``1 / (1 + exp(-v))`` compiles to ten, with range scaling to keep denormal results. So the
    sigmoid is 0, not a denormal, below v = -87.3 (``exp(-v)`` past 2^126), and ``exp(-v)`` is
    0 above v = 87.3, each in place of a value below 1.2e-38. SiLU, ``v * s``, is then a zero of
    v's sign from v = -87.3 where torch's float32 ``v / (1 + exp(-v))`` is -0.0 only from
    v = -88.7: a gate's ``silu(a) * b`` differs there by less than 1.1e-36 |b|."""
    if v.dtype == tl.float64:
        e = tl.exp(-v)
        s = 1 / (1 + e)
    else:
        e = helpers.exp2_approx(v * -LOG2_E)
        s = helpers.reciprocal_approx(e + 1)
    return s, e


@triton.jit
def sigmoid(v):
    """``1 / (1 + exp(-v))`` (see :func:`sigmoid_exp`)."""
    s, _ = sigmoid_exp(v)
    return s


@triton.jit
def gelu(v):
    """``0.5 v (1 + erf(v / sqrt 2))``, PyTorch's default GELU."""
    cdf2, _ = normal_cdf2(v)
    return 0.5 * v * cdf2


@triton.jit
def tanh_f64(z):
    """``tanh(z)`` in float64 as torch's float64 GELU sees it: ``±(1 - 2 / (1 + exp(2 |z|)))``, the
    subtraction from 1 last, so the result is rounded about once, as a library tanh's is, and
    exactly ±1 where it is within an ulp of it (``TANH_SATURATED``, as torch's tanh gives it), so
    that ``1 + tanh`` and ``1 - tanh^2`` cancel where they do in torch (``gelu_tanh(-10)`` is -0.0).
    Near 0 its error (an ulp of 1, not of tanh) is invisible in the ``1 + t`` and ``1 - t^2`` the
    GELU formulas take. (Triton's interpreter has no libdevice tanh.)"""
    rest = 2 / (tl.exp(tl.abs(z) * 2) + 1)  # 1 - |tanh z| (0 past |z| = 354, where exp overflows)
    magnitude = tl.where(rest < TANH_SATURATED * 2, 1.0, 1 - rest)
    return tl.where(z < 0, -magnitude, magnitude)


@triton.jit
def gelu_tanh_inner_f64(v):
    """torch's float64 ``kBeta (x + kKappa x^3)``, in its order of operations (tensors first: in
    Triton 3.9's interpreter a constexpr times a tensor is a constexpr)."""
    return (v + (v * v * v) * GELU_TANH_CUBIC) * SQRT_2_OVER_PI


@triton.jit
def gelu_tanh(v):
    """PyTorch's ``gelu(approximate="tanh")``. Below float64 as ``v * sigmoid(2 z)``, since
    ``0.5 (1 + tanh z) == sigmoid(2 z)``, which keeps relative accuracy where ``1 + tanh z``
    cancels; float64 with torch's own formula ``0.5 v (1 + tanh z)``, so it computes what
    torch computes there, its cancellation included (``gelu_tanh(-10)`` is -0.0, and times
    inf gives NaN, as in torch)."""
    if v.dtype == tl.float64:
        result = 0.5 * v * (1 + tanh_f64(gelu_tanh_inner_f64(v)))
    else:
        z = SQRT_2_OVER_PI * (v + GELU_TANH_CUBIC * v * v * v)
        result = v * sigmoid(2 * z)
    return result


@triton.jit
def gelu_derivative(v):
    """d gelu / dv = Phi(v) + v phi(v): the normal CDF plus ``v`` times its density."""
    cdf2, gauss = normal_cdf2(v)
    return 0.5 * cdf2 + v * (INV_SQRT_2PI * gauss)


@triton.jit
def sigmoid_pair(v):
    """``(sigmoid(v), 1 - sigmoid(v))`` with the second as ``exp(-v) sigmoid(v)``: no ``1 - s``
    to cancel where s is near 1 (at v = 11, ``1 - s`` rounded in float32 carries a relative error
    of 3e-3, which the derivatives below scaled into 16 ulp of their result, 1.9e-6 on the H200).
    Where ``exp(-v)`` exceeds 2^126, s is 0 and the second is 1."""
    s, e = sigmoid_exp(v)
    return s, tl.where(s == 0, 1.0, e * s)


@triton.jit
def gelu_tanh_derivative_f64(v):
    """torch's float64 tanh-GELU derivative, in its own terms: ``0.5 (1 + t) + 0.5 v (1 - t^2)
    kBeta (1 + 3 kKappa v^2)``, ``t = tanh z``. An infinite v, or one whose square overflows
    (|v| > 1.3e154), gives NaN (0 * inf), as in torch."""
    t = tanh_f64(gelu_tanh_inner_f64(v))
    left = 0.5 * v
    return (t + 1) * 0.5 + left * (1 - t * t) * SQRT_2_OVER_PI * ((v * v) * (3 * GELU_TANH_CUBIC) + 1)


@triton.jit
def gelu_tanh_derivative(v):
    """d gelu_tanh / dv with ``s = sigmoid(2 z)`` (``= 0.5 (1 + tanh z)``): ``s (1 + 2 v z' (1 - s))``,
    which has no ``1 - tanh^2`` to cancel where tanh is near 1 (as ``1 - 2 / (1 + exp(2 z))`` it
    lost 1.3e-5 at |grad| ~ 10 in float32). float64 takes torch's own formula
    (:func:`gelu_tanh_derivative_f64`)."""
    if v.dtype == tl.float64:
        result = gelu_tanh_derivative_f64(v)
    else:
        z = SQRT_2_OVER_PI * (v + GELU_TANH_CUBIC * v * v * v)
        s, rest = sigmoid_pair(2 * z)
        dz = SQRT_2_OVER_PI * (1 + 3 * GELU_TANH_CUBIC * v * v)
        # The second term is 0 where ``1 - s`` underflows (|v| dz rest < 1e-35 there), not inf * 0:
        # ``v dz`` overflows from |v| ~ 1.2e13. It is kept where s rounds to 1 (worth 9e-7 of the result
        # at v = 5.1 in float32: 16 ulp). Saturated to 0 below for finite v; an infinite v gives NaN, as
        # in torch.
        finite = v * 0 == 0
        term = tl.where(rest == 0, 0.0, 2 * v * dz * rest)
        slope = tl.where(s < TANH_SATURATED, 0.0, s * (1 + term))
        result = tl.where(finite, slope, v * 0)  # (NaN: inf * 0)
    return result


@triton.jit
def silu(v):
    """``v * sigmoid(v)``."""
    return v * sigmoid(v)


@triton.jit
def silu_derivative(v):
    """d silu / dv = s (1 + v (1 - s)), ``s = sigmoid(v)``."""
    s, rest = sigmoid_pair(v)
    return s * (1 + v * rest)


@triton.jit
def apply_activation(v, ACTIVATION: tl.constexpr):
    """The activation selected by a compile-time code from :data:`ACTIVATIONS`."""
    if ACTIVATION == ACT_RELU:
        v = relu(v)
    elif ACTIVATION == ACT_GELU:
        v = gelu(v)
    elif ACTIVATION == ACT_GELU_TANH:
        v = gelu_tanh(v)
    elif ACTIVATION == ACT_SILU:
        v = silu(v)
    return v


@triton.jit
def apply_activation_grad(grad, pre, ACTIVATION: tl.constexpr):
    """``grad * act'(pre)``: the gradient through the activation selected by a compile-time code,
    from its input. ReLU's passes the gradient where ``relu(pre)`` is positive or NaN, as
    PyTorch's ``threshold_backward`` does from the output."""
    if ACTIVATION == ACT_RELU:
        grad = tl.where(pre <= 0, 0.0, grad)
    elif ACTIVATION == ACT_GELU:
        grad = grad * gelu_derivative(pre)
    elif ACTIVATION == ACT_GELU_TANH:
        grad = grad * gelu_tanh_derivative(pre)
    elif ACTIVATION == ACT_SILU:
        grad = grad * silu_derivative(pre)
    return grad


@triton.jit
def add_scaled(x, y, alpha):
    """``x + alpha * y``, the arithmetic of ``torch.add(x, y, alpha=alpha)``: one fused
    multiply-add for floats, rounding once as torch's kernels do (an explicit ``tl.fma``,
    so Triton's interpreter rounds once too, as compiled code does after contraction)."""
    if x.dtype.is_floating():
        result = tl.fma(y, alpha, x)
    else:
        result = x + y * alpha
    return result


@triton.jit
def identity(v):
    """``v``: the math of a copy, whose loads and stores change the layout."""
    return v


@triton.jit
def add_math(x, y, alpha):
    """Registry math of ``add``."""
    return add_scaled(x, y, alpha)


@triton.jit
def add_relu_math(x, y, alpha):
    """Registry math of ``add_relu``."""
    return relu(add_scaled(x, y, alpha))


@triton.jit
def relu_grad_math(grad, out, alpha):
    """Registry math of ``relu_grad``: the gradient through a ReLU from its output,
    scaled by ``alpha``. Like PyTorch's ``threshold_backward``, a NaN output passes
    the gradient."""
    return tl.where(out <= 0, 0, grad * alpha)


@triton.jit
def gelu_grad_math(grad, pre):
    """Registry math of ``gelu_grad``: the gradient through GELU from its input."""
    return grad * gelu_derivative(pre)


@triton.jit
def gelu_tanh_grad_math(grad, pre):
    """Registry math of ``gelu_tanh_grad``."""
    return grad * gelu_tanh_derivative(pre)


@triton.jit
def silu_grad_math(grad, pre):
    """Registry math of ``silu_grad``."""
    return grad * silu_derivative(pre)


# --- Gates and bias + GELU (the registry's silu_mul, gelu_mul, add_gelu, their gradients) ---


@triton.jit
def silu_mul_math(a, b):
    """Registry math of ``silu_mul``: ``silu(a) * b``, the SwiGLU gate."""
    return silu(a) * b


@triton.jit
def gelu_mul_math(a, b):
    """Registry math of ``gelu_mul``: ``gelu(a) * b``, the GeGLU gate."""
    return gelu(a) * b


@triton.jit
def gelu_tanh_mul_math(a, b):
    """Registry math of ``gelu_tanh_mul``."""
    return gelu_tanh(a) * b


@triton.jit
def add_gelu_math(x, y, alpha):
    """Registry math of ``add_gelu``: ``gelu(x + alpha * y)``."""
    return gelu(add_scaled(x, y, alpha))


@triton.jit
def add_gelu_tanh_math(x, y, alpha):
    """Registry math of ``add_gelu_tanh``."""
    return gelu_tanh(add_scaled(x, y, alpha))


@triton.jit
def add_gelu_pre_math(x, y, alpha):
    """``add_gelu``'s forward under autograd: ``(gelu(x + alpha * y), x + alpha * y)``, the sum
    kept for the backward as ``F.gelu`` keeps its input."""
    pre = add_scaled(x, y, alpha)
    return gelu(pre), pre


@triton.jit
def add_gelu_tanh_pre_math(x, y, alpha):
    """``add_gelu_tanh``'s forward under autograd (see :func:`add_gelu_pre_math`)."""
    pre = add_scaled(x, y, alpha)
    return gelu_tanh(pre), pre


@triton.jit
def silu_mul_grad_math(grad, a, b):
    """Both gradients of ``silu(a) * b``, from one read of grad, a and b:
    ``(grad * b * silu'(a), grad * silu(a))``."""
    return grad * b * silu_derivative(a), grad * silu(a)


@triton.jit
def gelu_mul_grad_math(grad, a, b):
    """Both gradients of ``gelu(a) * b``."""
    return grad * b * gelu_derivative(a), grad * gelu(a)


@triton.jit
def gelu_tanh_mul_grad_math(grad, a, b):
    """Both gradients of ``gelu_tanh(a) * b``."""
    return grad * b * gelu_tanh_derivative(a), grad * gelu_tanh(a)
