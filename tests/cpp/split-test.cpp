#include <gradaccum/split.h>

#include "catch_torch.h"

TEST_CASE("split gives sizes differing by at most one, as views, in order", "[split]") {
  auto x = torch::arange(10).view({10, 1});
  auto parts = gradaccum::split(x, 3);
  REQUIRE(parts.size() == 3);
  CHECK(parts[0].size(0) == 4);
  CHECK(parts[1].size(0) == 3);
  CHECK(parts[2].size(0) == 3);
  CHECK(torch::equal(torch::cat(parts), x));
  CHECK(parts[1].data_ptr() == x[4].data_ptr()); // a view, no copy
}

TEST_CASE("split of several tensors keeps rows together", "[split]") {
  auto x = torch::randn({7, 2});
  auto y = torch::arange(7);
  auto parts = gradaccum::split(std::vector<at::Tensor>{x, y}, 2);
  REQUIRE(parts.size() == 2);
  CHECK(torch::equal(parts[1][0], x.narrow(0, 4, 3)));
  CHECK(torch::equal(parts[1][1], y.narrow(0, 4, 3)));
}

TEST_CASE("split rejects bad input with a clear message", "[split][errors]") {
  auto x = torch::randn({4, 2});
  CHECK_THROWS_WITH(gradaccum::split(x, 0), Catch::Contains("steps must be positive"));
  CHECK_THROWS_WITH(gradaccum::split(x, 5), Catch::Contains("cannot split 4 rows into 5"));
  CHECK_THROWS_WITH(gradaccum::split(std::vector<at::Tensor>{x, torch::randn({3})}, 2),
      Catch::Contains("different batch sizes"));
  CHECK_THROWS_WITH(gradaccum::split(torch::tensor(1.0), 1),
      Catch::StartsWith("gradaccum: split(): tensor 0 is a 0-dim tensor; it has no dim 0 to split along"));
  CHECK_THROWS_WITH(gradaccum::split(std::vector<at::Tensor>{}, 1), Catch::Contains("no tensor"));
  CHECK_THROWS_WITH(gradaccum::split(std::vector<at::Tensor>{x, torch::eye(4).to_sparse()}, 2),
      Catch::StartsWith("gradaccum: split(): tensor 1 is layout Sparse; only dense (strided) tensors split into "
                        "views: pass a dense (padded) tensor, or split the samples yourself"));
}
