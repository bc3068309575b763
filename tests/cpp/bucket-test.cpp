#include <gradaccum/bucket.h>

#include <catch2/catch.hpp>
#include <torch/torch.h>

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
  CHECK(bucket.meta_in_buffer);
  CHECK(bucket.buffer.numel() == 10 + gradaccum::kMetaHeader + 2); // gradients, header, two flags
  CHECK(gradaccum::kMetaHeader == 15);
  CHECK(bucket.views[0].sizes() == params[1].sizes());
  CHECK(bucket.views[1].sizes() == params[0].sizes());
  bucket.views[1].fill_(7);
  CHECK(bucket.gradients.narrow(0, 4, 6).eq(7).all().item<bool>());
  CHECK(bucket.bytes() == (10 + 15 + 2) * 4);

  std::vector<at::Tensor> half{torch::zeros({8}, torch::kBFloat16)};
  gradaccum::Bucket low(half, {0});
  CHECK_FALSE(low.meta_in_buffer); // counts need float32: meta goes separately
  CHECK(low.meta.scalar_type() == torch::kFloat);
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
