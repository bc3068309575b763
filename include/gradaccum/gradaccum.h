#pragma once

/// gradaccum: gradient accumulation with once-per-window, overlapped
/// data-parallel reduction for LibTorch.

#include <gradaccum/accumulator.h>
#include <gradaccum/bucket.h>
#include <gradaccum/model_parameters.h>
#include <gradaccum/options.h>
#include <gradaccum/process_group.h>
#include <gradaccum/reducer.h>
#include <gradaccum/state.h>
#include <gradaccum/stats.h>
#include <gradaccum/split.h>
#include <gradaccum/version.h>
