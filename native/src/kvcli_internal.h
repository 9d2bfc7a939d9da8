// Helpers shared by kvcli's own C++ sources (not part of the public C API).
#pragma once

#include <cstdint>
#include <exception>
#include <stdexcept>
#include <string>

// an error for the caller: becomes kvcli_last_error() and a negative return code
struct kvcli_error : std::runtime_error {
    using std::runtime_error::runtime_error;
};

// Set / clear the message returned by kvcli_last_error() on this thread.
void kvcli_set_error(const std::string & msg);
void kvcli_clear_error();

// Runs f() for a kvcli_* C entry point: clears the error, returns f()'s result, or -1 with the
// exception's message as kvcli_last_error() when f throws (no exception crosses the C API).
template <typename F>
int32_t kvcli_guarded(F && f) {
    try {
        kvcli_clear_error();
        return f();
    } catch (const std::exception & e) {
        kvcli_set_error(e.what());
        return -1;
    }
}
