#pragma once
// Forward declarations for ProcessGroupGloo.hpp; see src/shim/README.md.
namespace gloo {
namespace transport {
class Device;
class UnboundBuffer;
} // namespace transport
} // namespace gloo
