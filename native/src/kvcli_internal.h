// Helpers shared by kvcli's own C++ sources (not part of the public C API).
#pragma once

#include <string>

// Set / clear the message returned by kvcli_last_error() on this thread.
void kvcli_set_error(const std::string & msg);
void kvcli_clear_error();
