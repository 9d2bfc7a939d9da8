// Identity of the kvcli native library (what `kvcli info` reports to prove that the patched
// build is loaded) and the per-thread error message every kvcli_* call sets on failure.
#include "kvcli.h"
#include "kvcli_internal.h"

#include <string>

namespace {
thread_local std::string g_last_error;
}

void kvcli_set_error(const std::string & msg) { g_last_error = msg; }
void kvcli_clear_error() { g_last_error.clear(); }

extern "C" {

const char * kvcli_version(void)      { return KVCLI_VERSION_STR; }
const char * kvcli_llama_commit(void) { return KVCLI_LLAMA_COMMIT_STR; }
const char * kvcli_build_flags(void)  { return KVCLI_BUILD_FLAGS_STR; }
int32_t      kvcli_state_format(void) { return 2; } // 2: per-sequence re-indexing flag
const char * kvcli_last_error(void)   { return g_last_error.c_str(); }

}
