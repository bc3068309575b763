#include <gradaccum/bucket.h>

#include "catch_torch.h"

#include <cstdlib>
#include <optional>
#include <string>

using gradaccum::assign_buckets;

TEST_CASE("buckets follow reverse registration order, first one small", "[bucket]") {
  // Five 1000-float (4000-byte) parameters; first cap 4000 bytes, then 8000.
  std::vector<at::Tensor> params(5, torch::zeros({1000}));
  auto buckets = assign_buckets(params, 4000, 8000);
  REQUIRE(buckets.size() == 3);
  CHECK(buckets[0] == std::vector<size_t>{4});
  CHECK(buckets[1] == std::vector<size_t>{3, 2});
  CHECK(buckets[2] == std::vector<size_t>{1, 0});
}

TEST_CASE("an unset bucket cap is a sixteenth of the gradients across hosts, 25 MiB on one", "[bucket]") {
  constexpr int64_t MiB = int64_t{1} << 20;
  // Meta tensors: sizes and dtypes without memory.
  auto of = [](int64_t bytes, at::ScalarType dtype) {
    return torch::empty({bytes / static_cast<int64_t>(c10::elementSize(dtype))},
                        torch::TensorOptions().dtype(dtype).device(torch::kMeta));
  };
  using gradaccum::default_bucket_cap_bytes;
  const std::vector<at::Tensor> mid(32, of(2 * MiB, torch::kFloat32));
  CHECK(default_bucket_cap_bytes(mid, false) == 4 * MiB);
  // bf16 and float64 count in their own bytes: 48 + 16 MiB.
  CHECK(default_bucket_cap_bytes({of(48 * MiB, torch::kBFloat16), of(16 * MiB, torch::kFloat64)}, false) == 4 * MiB);
  CHECK(default_bucket_cap_bytes({of(8 * MiB, torch::kFloat32)}, false) == 1 * MiB); // at least 1 MiB
  CHECK(default_bucket_cap_bytes({}, false) == 1 * MiB);
  CHECK(default_bucket_cap_bytes({of(400 * MiB, torch::kFloat32)}, false) == 25 * MiB);
  CHECK(default_bucket_cap_bytes({of(4000 * MiB, torch::kFloat32)}, false) == 25 * MiB); // at most DDP's
  CHECK(default_bucket_cap_bytes({of(160 * MiB, torch::kFloat32)}, false) == 10 * MiB);
  // Every rank on one host: DDP's 25 MiB, whatever the model.
  CHECK(default_bucket_cap_bytes(mid, true) == 25 * MiB);
  CHECK(default_bucket_cap_bytes({of(8 * MiB, torch::kFloat32)}, true) == 25 * MiB);
  CHECK(default_bucket_cap_bytes({of(4000 * MiB, torch::kFloat32)}, true) == 25 * MiB);

  // The launch tells through LOCAL_WORLD_SIZE and WORLD_SIZE (torchrun's);
  // the one-argument call follows it.
  struct Env {
    const char* name;
    std::optional<std::string> saved;
    explicit Env(const char* n) : name(n) {
      if (const char* v = std::getenv(n)) {
        saved = v;
      }
    }
    ~Env() {
      saved ? setenv(name, saved->c_str(), 1) : unsetenv(name);
    }
  } local("LOCAL_WORLD_SIZE"), world("WORLD_SIZE");
  auto launch = [](const char* local_ws, const char* world_ws) {
    local_ws ? setenv("LOCAL_WORLD_SIZE", local_ws, 1) : unsetenv("LOCAL_WORLD_SIZE");
    world_ws ? setenv("WORLD_SIZE", world_ws, 1) : unsetenv("WORLD_SIZE");
    return gradaccum::launched_on_one_host();
  };
  CHECK(launch("4", "4"));
  CHECK(default_bucket_cap_bytes(mid) == 25 * MiB);
  CHECK_FALSE(launch("2", "4")); // two hosts
  CHECK(default_bucket_cap_bytes(mid) == 4 * MiB);
  CHECK_FALSE(launch(nullptr, "4")); // the launch does not tell
  CHECK_FALSE(launch("4", nullptr));
  CHECK_FALSE(launch(nullptr, nullptr));
  CHECK_FALSE(launch("", ""));
  CHECK_FALSE(launch("4x", "4x")); // malformed
  CHECK_FALSE(launch("0", "0"));
  CHECK_FALSE(launch("-1", "-1"));
  CHECK(launch("1", "1"));
}

TEST_CASE("buckets never mix dtypes", "[bucket]") {
  std::vector<at::Tensor> params{
      torch::zeros({10}), torch::zeros({10}, torch::kFloat64), torch::zeros({10})};
  auto buckets = assign_buckets(params, 1 << 20, 1 << 20);
  REQUIRE(buckets.size() == 2);
  for (const auto& b : buckets) {
    for (auto i : b) CHECK(params[i].scalar_type() == params[b.front()].scalar_type());
  }
}

TEST_CASE("a bucket's views tile its buffer and meta rides along", "[bucket]") {
  std::vector<at::Tensor> params{torch::zeros({2, 3}), torch::zeros({4})};
  gradaccum::Bucket bucket(params, {1, 0});
  CHECK(bucket.encoding == gradaccum::MetaEncoding::kPlain);
  CHECK(bucket.wire.is_same(bucket.buffer));
  CHECK(bucket.buffer.numel() == 10 + gradaccum::kMetaHeader + 2); // gradients, header, two flags
  CHECK(gradaccum::kMetaHeader == 45); // 37 fields (14 of them abort reasons), then 8 window metrics
  CHECK(bucket.views[0].sizes() == params[1].sizes());
  CHECK(bucket.views[1].sizes() == params[0].sizes());
  bucket.views[1].fill_(7);
  CHECK(bucket.gradients.narrow(0, 4, 6).eq(7).all().item<bool>());
  CHECK(bucket.bytes() == (10 + 45 + 2) * 4);
  CHECK(bucket.collectives() == 1);
}

namespace {

// What an all-reduce of the meta over `ranks` would leave (the sum, in the
// meta's own dtype: the digit sums must be exact there).
std::vector<double> summed_meta(gradaccum::Bucket& bucket, const std::vector<std::vector<double>>& ranks) {
  auto sum = torch::zeros_like(bucket.meta);
  for (const auto& values : ranks) {
    bucket.write_meta(values);
    sum.add_(bucket.meta);
  }
  bucket.meta.copy_(sum);
  return bucket.read_meta();
}

} // namespace

TEST_CASE("half-precision wires carry the meta as exact digits, in one collective", "[bucket]") {
  for (const auto dtype : {torch::kBFloat16, torch::kHalf}) {
    for (const int world : {2, 4, 16}) {
      std::vector<at::Tensor> half{torch::zeros({8}, dtype), torch::zeros({3}, dtype)};
      gradaccum::BucketConfig config;
      config.world = world;
      gradaccum::Bucket bucket(half, {1, 0}, config);
      CAPTURE(dtype, world);
      REQUIRE(bucket.encoding == gradaccum::MetaEncoding::kDigits);
      CHECK(bucket.collectives() == 1);
      CHECK(bucket.meta.scalar_type() == dtype);
      CHECK(bucket.meta.data_ptr() != nullptr);
      CHECK(bucket.wire.numel() == 11 + bucket.meta.numel());
      // Per-rank values far beyond what bf16 holds exactly, and fractional weights.
      std::vector<std::vector<double>> ranks;
      std::vector<double> expected(gradaccum::kMetaHeader + 2, 0.0);
      for (int r = 0; r < world; ++r) {
        std::vector<double> values(gradaccum::kMetaHeader + 2, 0.0);
        values[gradaccum::kWeight] = 4093.5 + r * 1e6 + 0.25;
        // The integer fields; digits carry no loss or metrics (0, no room).
        // Each rank sends 0 or 1 in the counts (one digit each).
        for (int64_t f = 1; f < gradaccum::kLoss; ++f) {
          const bool count = f == gradaccum::kFlushing || f == gradaccum::kFlushingSteps || f == gradaccum::kAbort || f == gradaccum::kJoined ||
              f == gradaccum::kInexactWeight || f == gradaccum::kUnstepped ||
              (f >= gradaccum::kAbortReasons && f < gradaccum::kAbortReasons + gradaccum::kAbortReasonSlots);
          values[f] = count ? static_cast<double>((f + r) % 2)
                            : static_cast<double>((f * 65521 + r * 977) % (int64_t{1} << 31));
        }
        values[gradaccum::kMetaHeader] = r == 0 ? 1 : 0; // a flag set on one rank only
        values[gradaccum::kMetaHeader + 1] = 0;
        for (size_t i = 0; i < values.size(); ++i) {
          expected[i] += values[i];
        }
        ranks.push_back(values);
      }
      const auto got = summed_meta(bucket, ranks);
      for (size_t i = 0; i < expected.size(); ++i) {
        CAPTURE(i);
        CHECK(got[i] == expected[i]);
      }
    }
  }
}

TEST_CASE("a half wire with more ranks than digits allow sends the meta apart", "[bucket]") {
  std::vector<at::Tensor> half{torch::zeros({8}, torch::kBFloat16)};
  gradaccum::BucketConfig config;
  config.world = 300; // 300 * (2^1 - 1) > 256
  gradaccum::Bucket low(half, {0}, config);
  CHECK(low.encoding == gradaccum::MetaEncoding::kSeparate);
  CHECK(low.meta.scalar_type() == torch::kFloat);
  CHECK(low.collectives() == 2);
}

TEST_CASE("comm_dtype gives the bucket a wire of its own; error feedback a residual", "[bucket]") {
  std::vector<at::Tensor> params{torch::zeros({5}), torch::zeros({3})};
  gradaccum::BucketConfig config;
  config.comm_dtype = torch::kBFloat16;
  config.world = 2;
  config.error_feedback = true;
  gradaccum::Bucket bucket(params, {1, 0}, config);
  CHECK(bucket.compressed);
  CHECK_FALSE(bucket.accumulating);
  CHECK(bucket.buffer.scalar_type() == torch::kFloat);
  CHECK(bucket.buffer.numel() == 8);
  CHECK(bucket.wire.scalar_type() == torch::kBFloat16);
  CHECK(bucket.wire_gradients.numel() == 8);
  CHECK(bucket.encoding == gradaccum::MetaEncoding::kDigits);
  CHECK(bucket.residual.defined());
  CHECK(bucket.residual.numel() == 8);
  CHECK(bucket.bytes() == bucket.wire.numel() * 2);

  // bf16 parameters summed in float32, sent in bf16 (no error feedback asked).
  std::vector<at::Tensor> half{torch::zeros({4}, torch::kBFloat16)};
  gradaccum::BucketConfig wide;
  wide.accumulate_dtype = torch::kFloat;
  wide.comm_dtype = torch::kBFloat16;
  gradaccum::Bucket both(half, {0}, wide);
  CHECK(both.accumulating);
  CHECK(both.compressed);
  CHECK(both.gradients.scalar_type() == torch::kFloat);
  CHECK(both.wire.scalar_type() == torch::kBFloat16);
  CHECK_FALSE(both.residual.defined());
}

TEST_CASE("buckets follow a ready order when one is given", "[bucket]") {
  std::vector<at::Tensor> params(5, torch::zeros({1000}));
  // Backward seen to produce them in registration order (modules built out of order).
  auto buckets = assign_buckets(params, 4000, 8000, {0, 1, 2, 3, 4});
  REQUIRE(buckets.size() == 3);
  CHECK(buckets[0] == std::vector<size_t>{0});
  CHECK(buckets[1] == std::vector<size_t>{1, 2});
  CHECK(buckets[2] == std::vector<size_t>{3, 4});
  // The default is reverse registration order.
  CHECK(assign_buckets(params, 4000, 8000, {4, 3, 2, 1, 0}) == assign_buckets(params, 4000, 8000));
  CHECK_THROWS_WITH(assign_buckets(params, 4000, 8000, {0, 1, 1, 3, 4}),
                    Catch::Contains("not a permutation"));
  CHECK_THROWS_WITH(assign_buckets(params, 4000, 8000, {0, 1}), Catch::Contains("2 entries for 5"));
}
