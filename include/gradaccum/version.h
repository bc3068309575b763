#pragma once

// The one place gradaccum's version is written: CMakeLists.txt and setup.py
// read these three lines; everything else derives from them.
#define GRADACCUM_VERSION_MAJOR 0
#define GRADACCUM_VERSION_MINOR 2
#define GRADACCUM_VERSION_PATCH 0

#define GRADACCUM_STRINGIFY_(x) #x
#define GRADACCUM_STRINGIFY(x) GRADACCUM_STRINGIFY_(x)
/// "MAJOR.MINOR.PATCH"
#define GRADACCUM_VERSION                          \
  GRADACCUM_STRINGIFY(GRADACCUM_VERSION_MAJOR) "." \
  GRADACCUM_STRINGIFY(GRADACCUM_VERSION_MINOR) "." \
  GRADACCUM_STRINGIFY(GRADACCUM_VERSION_PATCH)
