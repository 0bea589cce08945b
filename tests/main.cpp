// Catch2 entry point, the same for v2 and v3.
#define CATCH_CONFIG_RUNNER
#include "tests/catch_compat.h"

int main(int argc, char* argv[]) {
  return Catch::Session().run(argc, argv);
}
