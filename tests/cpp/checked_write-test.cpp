#include <gradaccum/detail/checked_write.h>

#include "catch_torch.h"

#include <cmath>
#include <cstring>
#include <limits>

using gradaccum::detail::write_checked;

namespace {

// What the reducer did before: ATen's division by a CPU double scalar.
torch::Tensor aten_divide(const torch::Tensor& in, double divisor) {
  auto out = torch::empty_like(in);
  at::div_out(out, in, at::scalar_tensor(divisor, at::kDouble));
  return out;
}

bool same_bits(const torch::Tensor& a, const torch::Tensor& b) {
  return a.sizes() == b.sizes() && a.strides() == b.strides() &&
      std::memcmp(a.data_ptr(), b.data_ptr(), a.nbytes()) == 0;
}

} // namespace

TEST_CASE("the checked write divides as ATen does, bit for bit", "[checked_write]") {
  torch::manual_seed(0);
  for (auto dtype : {torch::kFloat32, torch::kFloat64}) {
    // odd sizes (vector tails), small and denormal values, both signs
    auto in = torch::randn({100003}, dtype) * torch::pow(10.0, torch::randint(-40, 10, {100003}, dtype));
    for (double divisor : {1.0, 2.0, 3.0, 7.0, 0.3, 24.0, 12345.0, 1.0 / 3.0}) {
      auto out = torch::empty_like(in);
      CHECK(write_checked(out, in, divisor, in.numel()));
      CHECK(same_bits(out, aten_divide(in, divisor)));
      auto inplace = in.clone();
      CHECK(write_checked(inplace, inplace, divisor, in.numel()));
      CHECK(same_bits(inplace, aten_divide(in, divisor)));
    }
    auto copy = torch::empty_like(in);
    CHECK(write_checked(copy, in, std::nullopt, in.numel()));
    CHECK(same_bits(copy, in));
    CHECK(write_checked(torch::Tensor(), in, std::nullopt, in.numel())); // a check alone
  }
}

TEST_CASE("dividing by a power of two gives ATen's bits, edge values included", "[checked_write]") {
  // Note [Dividing by a power of two]: the powers of two multiply by their
  // reciprocal, except 2^127 in float (its reciprocal is subnormal); -2 and
  // 2 + 1e-6 divide.
  torch::manual_seed(1);
  for (auto dtype : {torch::kFloat32, torch::kFloat64}) {
    auto in = torch::randn({4099}, dtype) * torch::pow(10.0, torch::randint(-45, 38, {4099}, dtype));
    const bool is_float = dtype == torch::kFloat32;
    const double max = is_float ? std::numeric_limits<float>::max() : std::numeric_limits<double>::max();
    const double tiny = is_float ? std::numeric_limits<float>::denorm_min() : std::numeric_limits<double>::denorm_min();
    const double edges[] = {max, -max, tiny, -tiny, 0.0, -0.0, double(INFINITY), -double(INFINITY), std::nan("")};
    for (size_t i = 0; i < std::size(edges); ++i) {
      in[static_cast<int64_t>(i) * 401] = edges[i];
    }
    for (double divisor : {8.0, 0.5, 0.25, std::ldexp(1.0, 60), std::ldexp(1.0, -60), std::ldexp(1.0, 120),
                           std::ldexp(1.0, 127), -2.0, 2.0 + 1e-6}) {
      auto out = torch::empty_like(in);
      write_checked(out, in, divisor, in.numel());
      CHECK(same_bits(out, aten_divide(in, divisor)));
      auto inplace = in.clone();
      write_checked(inplace, inplace, divisor, in.numel());
      CHECK(same_bits(inplace, aten_divide(in, divisor)));
    }
  }
}

TEST_CASE("the checked write finds what would make the norm non-finite", "[checked_write]") {
  for (auto dtype : {torch::kFloat32, torch::kFloat64}) {
    const double max = dtype == torch::kFloat32 ? std::numeric_limits<float>::max() : std::numeric_limits<double>::max();
    for (double bad : {std::nan(""), double(INFINITY), -double(INFINITY)}) {
      auto in = torch::ones({70000}, dtype);
      in[54321] = bad; // in the vectorised body, and in a tail
      auto out = torch::empty_like(in);
      CHECK_FALSE(write_checked(out, in, 2.0, in.numel()));
      CHECK(same_bits(out, aten_divide(in, 2.0))); // written anyway
      in[54321] = 1;
      in[69999] = bad;
      CHECK_FALSE(write_checked(out, in, std::nullopt, in.numel()));
    }
    // Finite, but the window's norm over these values would overflow.
    const auto terms = int64_t{1000};
    auto in = torch::full({terms}, std::sqrt(max / terms) * 1.01, dtype);
    CHECK(std::isinf(torch::linalg_vector_norm(in, 2, {}, false, {}).item<double>()));
    CHECK_FALSE(write_checked(torch::empty_like(in), in, std::nullopt, terms));
    // Everything up to the bound: the norm is finite.
    auto fine = torch::full({terms}, std::sqrt(max / (4.0 * terms)) * 0.999, dtype);
    CHECK(write_checked(torch::empty_like(fine), fine, std::nullopt, terms));
    CHECK(std::isfinite(torch::linalg_vector_norm(fine, 2, {}, false, {}).item<double>()));
  }
}

TEST_CASE("the checked write leaves what it cannot check to ATen", "[checked_write]") {
  auto half = torch::randn({33}).to(torch::kBFloat16);
  auto out = torch::empty_like(half);
  CHECK_FALSE(write_checked(out, half, 3.0, 33)); // unknown, but written
  CHECK(torch::equal(out, aten_divide(half, 3.0)));
  auto in = torch::randn({8, 3, 4, 5});
  CHECK_FALSE(write_checked(torch::empty_like(in), in, 3.0, 0)); // not asked to check
  // channels_last on both sides: checked, in storage order
  auto cl = torch::randn({2, 3, 4, 5}).contiguous(torch::MemoryFormat::ChannelsLast);
  auto cl_out = torch::empty_like(cl);
  CHECK(write_checked(cl_out, cl, 3.0, cl.numel()));
  CHECK(same_bits(cl_out, aten_divide(cl, 3.0)));
  // different layouts: ATen
  auto plain_out = torch::empty({2, 3, 4, 5});
  CHECK_FALSE(write_checked(plain_out, cl, 3.0, cl.numel()));
  CHECK(torch::equal(plain_out, aten_divide(cl, 3.0)));
}
