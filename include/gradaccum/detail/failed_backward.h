#pragma once
// Internal: the exception a synchronising backward's own backward raised on
// this rank, kept for the Python binding (Note [An interrupt in a
// synchronising backward], python/gradaccum/csrc/bindings.cpp), and what the
// binding can tell of such an error (Note [An interrupt tells every rank to
// end], src/reducer/hooks.cpp).

#include <exception>
#include <string>

namespace gradaccum::detail {

/// Kept by Reducer::backward() when the graph's backward raised here and the
/// window was dropped on every rank: the drop raises gradaccum's own error,
/// and this is what it replaced. `raise_original`: the binding raises the
/// original itself whatever its type (gradaccum's text as its note), as a
/// failure that dropped nothing yet would have been raised; otherwise only
/// an interrupt. One per thread; a later keep replaces it.
void keep_failed_backward(std::exception_ptr error, bool raise_original = false) noexcept;

struct KeptFailure {
  std::exception_ptr error;
  bool raise_original = false;
};

/// Hands over (and forgets) what this thread kept (a null error: nothing).
/// The binding takes it after every call that can run a synchronising
/// backward, with the GIL held: a kept Python error must not outlive the
/// interpreter.
KeptFailure take_failed_backward() noexcept;

/// What the Python binding tells of an error (a C++ program registers none).
struct ErrorFacts {
  /// A Python error that is no Exception (KeyboardInterrupt, SystemExit):
  /// it stops its rank.
  bool interrupt = false;
  /// Its Python type's name; empty for a C++ error.
  std::string type;
};
using ErrorInspector = ErrorFacts (*)(const std::exception_ptr& error);

/// Registered once, by the Python binding at import.
void set_error_inspector(ErrorInspector inspector) noexcept;

/// The facts of `error`; {} without an inspector, or where it fails.
ErrorFacts inspect_error(const std::exception_ptr& error) noexcept;

/// `message` (an exception's what()), or where it says nothing (a bare
/// `raise KeyboardInterrupt`, Python's "python_error"), the type `facts` name.
std::string named_message(const std::string& message, const ErrorFacts& facts);

} // namespace gradaccum::detail
