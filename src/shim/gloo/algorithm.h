#pragma once
// Forward declarations for ProcessGroupGloo.hpp; see src/shim/README.md.
#include <gloo/context.h>
