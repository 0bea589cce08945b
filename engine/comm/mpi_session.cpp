#include "engine/comm/mpi_session.h"

#define OMPI_SKIP_MPICXX 1  // the C API is all we use
#define MPICH_SKIP_MPICXX 1
#include <mpi.h>

#include <fmt/format.h>

#include <mutex>
#include <string>

#include "shardswap/error.h"

namespace shardswap {

namespace {

void check(int status, const char* who, const char* statement) {
  if (status == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING] = {};
  int length = 0;
  if (MPI_Error_string(status, text, &length) != MPI_SUCCESS) length = 0;
  throw CommError(fmt::format("{}: {} failed: {}", who, statement,
                              length > 0 ? std::string(text, static_cast<std::size_t>(length))
                                         : fmt::format("error {}", status)));
}

}  // namespace

std::shared_ptr<MpiSession> MpiSession::acquire(const char* who, int* argc, char*** argv) {
  static std::mutex mutex;
  static std::weak_ptr<MpiSession> current;
  std::lock_guard lock(mutex);
  if (auto session = current.lock()) return session;
  int initialized = 0, finalized = 0;
  check(MPI_Initialized(&initialized), who, "MPI_Initialized");
  check(MPI_Finalized(&finalized), who, "MPI_Finalized");
  if (finalized)
    throw CommError(fmt::format(
        "{}: MPI was already finalized in this process (it is finalized when the last "
        "communicator made over it goes, if MPI was initialized here)",
        who));
  if (!initialized) {
    int provided = 0;
    check(MPI_Init_thread(argc, argv, MPI_THREAD_SERIALIZED, &provided), who, "MPI_Init_thread");
  }
  auto session = std::make_shared<MpiSession>(/*owns=*/!initialized);
  current = session;
  return session;
}

MpiSession::~MpiSession() {
  if (!owns_ || leaked_) return;
  int finalized = 1;
  MPI_Finalized(&finalized);
  if (!finalized) MPI_Finalize();
}

}  // namespace shardswap
