#pragma once
// Internal: the exception a synchronising backward's own backward raised on
// this rank, kept for the Python binding (Note [An interrupt in a
// synchronising backward], python/gradaccum/csrc/bindings.cpp).

#include <exception>

namespace gradaccum::detail {

/// Kept by Reducer::backward() when the graph's backward raised here and the
/// window was dropped on every rank: the drop raises gradaccum's own error,
/// and this is what it replaced. One per thread; a later keep replaces it.
void keep_failed_backward(std::exception_ptr error) noexcept;

/// Hands over (and forgets) what this thread kept, or null. The binding
/// takes it after every call that can run a synchronising backward, with the
/// GIL held: a kept Python error must not outlive the interpreter.
std::exception_ptr take_failed_backward() noexcept;

} // namespace gradaccum::detail
