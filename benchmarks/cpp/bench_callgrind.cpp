// Valgrind client requests for Python (benchmarks/_bench_worker.py --instr loads
// this with ctypes): Python cannot issue them itself. Each call costs the same
// few instructions in every contender; outside valgrind they do nothing.
//
// A section is counted with instrumentation switched on and off around it,
// not with CALLGRIND_TOGGLE_COLLECT: collection is a per-thread state in
// callgrind, so toggling it from the main thread would leave Gloo's threads
// (where the all-reduce runs) uncounted. Instrumentation is global.
#include <valgrind/callgrind.h>

extern "C" {
void ga_begin() {
  CALLGRIND_START_INSTRUMENTATION;
  CALLGRIND_ZERO_STATS;
}
void ga_end(const char* label) {
  CALLGRIND_STOP_INSTRUMENTATION;
  CALLGRIND_DUMP_STATS_AT(label);
}
int ga_running_on_valgrind() { return RUNNING_ON_VALGRIND; }
}
