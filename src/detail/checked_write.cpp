#include <gradaccum/detail/checked_write.h>

#include <ATen/ATen.h>
#include <ATen/MemoryOverlap.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <cmath>
#include <limits>
#include <optional>
#include <type_traits>

namespace gradaccum::detail {
namespace {

enum class Mode { Divide, DivideInPlace, Scale, ScaleInPlace, Copy, CheckOnly };

// The magnitude's bits: for floats of one sign, the unsigned order of their
// bits is the order of their values, and every NaN sorts above infinity. So
// the check is one integer max per value, which the compiler vectorises (an
// integer reduction, unlike a float one): max(bits(|v|)) <= bits(bound) holds
// iff every value is finite and |v| <= bound.
template <typename T>
using Bits = std::conditional_t<sizeof(T) == 4, uint32_t, uint64_t>;

template <typename T>
inline Bits<T> magnitude(T v) {
  return std::bit_cast<Bits<T>>(v) & (std::numeric_limits<Bits<T>>::max() >> 1);
}

// Note [Dividing by a power of two]
// x / 2^k and x * 2^-k are the same real number, and IEEE arithmetic rounds
// each once, to nearest: the same bits for every x, subnormal results, zeros,
// infinities and NaNs included. Where the divisor and its reciprocal are both
// normal powers of two (world size times K usually is), the pass multiplies:
// one instruction that also loads, where a division needs a load of its own
// and many cycles. Any other divisor divides. The checked-write test compares
// both against ATen's division bit for bit.
template <typename T>
std::optional<T> exact_reciprocal(T divisor) {
  int exponent = 0;
  if (!std::isnormal(divisor) || std::frexp(divisor, &exponent) != T(0.5)) {
    return std::nullopt;
  }
  const T reciprocal = T(1) / divisor;
  if (!std::isnormal(reciprocal)) {
    return std::nullopt;
  }
  return reciprocal;
}

// One loop per mode, with no branch inside, unrolled so that the loop's own
// counting is a small part of each vector's instructions. The division is
// IEEE's, as ATen's kernel: the same bits. Scale multiplies by the divisor's
// reciprocal where that gives the same bits (Note [Dividing by a power of two]).
template <typename T, Mode M>
inline __attribute__((always_inline)) Bits<T> check_loop(T* out, const T* in, int64_t n, T divisor) {
  Bits<T> largest = 0;
  if constexpr (M == Mode::DivideInPlace || M == Mode::ScaleInPlace) {
#pragma GCC unroll 4
    for (int64_t i = 0; i < n; ++i) {
      const T v = M == Mode::DivideInPlace ? out[i] / divisor : out[i] * divisor;
      out[i] = v;
      largest = std::max(largest, magnitude(v));
    }
  } else {
#pragma GCC unroll 4
    for (int64_t i = 0; i < n; ++i) {
      const T v = M == Mode::Divide ? in[i] / divisor : M == Mode::Scale ? in[i] * divisor : in[i];
      if constexpr (M != Mode::CheckOnly) {
        out[i] = v;
      }
      largest = std::max(largest, magnitude(v));
    }
  }
  return largest;
}

template <typename T>
inline __attribute__((always_inline)) bool dispatch(Mode mode, T* out, const T* in, int64_t n, T divisor, T bound) {
  Bits<T> largest = 0;
  switch (mode) {
    case Mode::Divide: largest = check_loop<T, Mode::Divide>(out, in, n, divisor); break;
    case Mode::DivideInPlace: largest = check_loop<T, Mode::DivideInPlace>(out, in, n, divisor); break;
    case Mode::Scale: largest = check_loop<T, Mode::Scale>(out, in, n, divisor); break;
    case Mode::ScaleInPlace: largest = check_loop<T, Mode::ScaleInPlace>(out, in, n, divisor); break;
    case Mode::Copy: largest = check_loop<T, Mode::Copy>(out, in, n, divisor); break;
    case Mode::CheckOnly: largest = check_loop<T, Mode::CheckOnly>(out, in, n, divisor); break;
  }
  return largest <= magnitude(bound);
}

// Built for AVX2 too on x86, picked at load time where the CPU has it (as
// ATen's own kernels are): the pass then costs what ATen's division alone
// costs. Other architectures (aarch64) get the portable build.
#if defined(__x86_64__) || defined(__i386__)
#define GRADACCUM_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define GRADACCUM_CLONES
#endif

GRADACCUM_CLONES
bool check_range(Mode mode, float* out, const float* in, int64_t n, float divisor, float bound) {
  return dispatch(mode, out, in, n, divisor, bound);
}

GRADACCUM_CLONES
bool check_range(Mode mode, double* out, const double* in, int64_t n, double divisor, double bound) {
  return dispatch(mode, out, in, n, divisor, bound);
}

bool write_unchecked(const at::Tensor& out, const at::Tensor& in, std::optional<double> divisor) {
  if (!out.defined()) {
    return false;
  }
  if (divisor) {
    // A CPU double scalar: the division runs in the gradients' compute type
    // without rounding the divisor to a half-precision dtype first.
    const auto scalar = at::scalar_tensor(*divisor, at::kDouble);
    if (out.is_same(in)) {
      out.div_(scalar);
    } else {
      at::div_out(const_cast<at::Tensor&>(out), in, scalar);
    }
  } else if (!out.is_same(in)) {
    out.copy_(in);
  }
  return false;
}

} // namespace

bool write_checked(const at::Tensor& out, const at::Tensor& in, std::optional<double> divisor, int64_t norm_terms) {
  const auto dtype = in.scalar_type();
  const bool in_place = out.defined() && out.is_same(in);
  const bool checkable = norm_terms > 0 && in.device().is_cpu() && !in.is_sparse() &&
      (dtype == at::kFloat || dtype == at::kDouble) && in.is_non_overlapping_and_dense() &&
      (!out.defined() || in_place ||
       (out.device().is_cpu() && out.scalar_type() == dtype && out.sizes() == in.sizes() &&
        out.strides() == in.strides() && out.is_non_overlapping_and_dense() &&
        at::get_overlap_status(out, in) == at::MemOverlapStatus::No));
  if (!checkable) {
    return write_unchecked(out, in, divisor);
  }
  Mode mode = !out.defined() ? Mode::CheckOnly
      : divisor ? (in_place ? Mode::DivideInPlace : Mode::Divide)
      : in_place ? Mode::CheckOnly : Mode::Copy;
  std::atomic<bool> bounded{true};
  AT_DISPATCH_FLOATING_TYPES(dtype, "gradaccum::write_checked", [&] {
    // Every term below bound^2 = max / (4 * terms): the sum of squares stays
    // below a quarter of the dtype's largest value, rounding included.
    const auto bound = static_cast<scalar_t>(std::sqrt(
        static_cast<double>(std::numeric_limits<scalar_t>::max()) / (4.0 * static_cast<double>(norm_terms))));
    auto d = static_cast<scalar_t>(divisor.value_or(1.0));
    if (mode == Mode::Divide || mode == Mode::DivideInPlace) {
      if (const auto reciprocal = exact_reciprocal(d)) {
        d = *reciprocal;
        mode = mode == Mode::Divide ? Mode::Scale : Mode::ScaleInPlace;
      }
    }
    // Dense with equal strides: both walk their storage in the same order.
    const scalar_t* src = in.const_data_ptr<scalar_t>();
    scalar_t* dst = out.defined() ? out.mutable_data_ptr<scalar_t>() : nullptr;
    at::parallel_for(0, in.numel(), at::internal::GRAIN_SIZE, [&](int64_t begin, int64_t end) {
      if (!check_range(mode, dst ? dst + begin : nullptr, src + begin, end - begin, d, bound)) {
        bounded.store(false, std::memory_order_relaxed);
      }
    });
  });
  if (out.defined() && mode != Mode::CheckOnly) {
    out.unsafeGetTensorImpl()->bump_version(); // written, as at::div_out would have
  }
  return bounded.load();
}

} // namespace gradaccum::detail
