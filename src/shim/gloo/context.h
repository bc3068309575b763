#pragma once
// Forward declarations for ProcessGroupGloo.hpp; see src/shim/README.md.
#include <chrono>

namespace gloo {
class Context {
 public:
  void setTimeout(std::chrono::milliseconds timeout);
};
} // namespace gloo
