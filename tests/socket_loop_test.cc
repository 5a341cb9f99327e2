// The socket data plane's event loop in process, with handlers the test
// controls: what a loop held up by a slow call does with the connections
// that waited on it (cachestore/socket_dataplane.cc).
#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <future>
#include <string>
#include <thread>

#include "cachestore/socket_dataplane.h"
#include "common/socket_io.h"
#include "tests/raw_hello.h"
#include "tests/test_util.h"

namespace kvtier {
namespace {

using store::SocketDataPlane;
using namespace std::chrono_literals;

constexpr auto kHelloTimeout = 200ms;

// A connection that said its hello: a reply of code 0 came back.
struct Raw {
  int fd = -1;
  std::string nonce;
  ~Raw() {
    if (fd >= 0) close(fd);
  }
};

absl::Status Open(int port, Raw* r) {
  const auto by = net::Clock::now() + 5s;
  auto fd = net::Connect("127.0.0.1", port, by);
  if (!fd.ok()) return fd.status();
  r->fd = *fd;
  auto nonce = testing::ReadChallenge(r->fd, by);
  if (!nonce.ok()) return nonce.status();
  r->nonce = *nonce;
  return absl::OkStatus();
}

absl::Status SendHello(const Raw& r) {
  const std::string payload =
      testing::HelloFor(std::string(wire::kSocketSessionBytes, 's'), r.nonce);
  wire::Frame f;
  f.op = wire::kHello;
  f.length = payload.size();
  iovec v[2] = {{&f, sizeof(f)}, {const_cast<char*>(payload.data()), payload.size()}};
  return net::WriteAll(r.fd, v, 2, net::Clock::now() + 5s);
}

// The code of the next reply (its message skipped), or an error when the
// store closed the connection instead.
absl::StatusOr<int> ReplyCode(const Raw& r) {
  const auto by = net::Clock::now() + 10s;
  wire::Reply reply;
  if (auto s = net::ReadAll(r.fd, &reply, sizeof(reply), by); !s.ok()) return s;
  std::string rest(reply.message_bytes + reply.data_bytes, '\0');
  if (auto s = net::ReadAll(r.fd, rest.data(), rest.size(), by); !s.ok()) return s;
  return reply.code;
}

TEST(SocketLoop, AHelloThatArrivedWhileItsLoopWasHeldUpIsReadNotTimedOut) {
  SocketDataPlane::Options o;
  o.threads = 1;  // one loop: the slow call holds up every connection
  o.hello_timeout = std::chrono::duration_cast<std::chrono::milliseconds>(kHelloTimeout);
  auto plane = SocketDataPlane::Start("127.0.0.1:0", o);
  ASSERT_TRUE(plane.ok()) << plane.status();
  std::promise<void> entered, release;
  std::shared_future<void> released = release.get_future().share();
  // A failed assertion below still lets the call end (the plane's loop
  // joins when it goes).
  struct Let {
    std::promise<void>& go;
    void Now() {
      try {
        go.set_value();
      } catch (const std::future_error&) {  // let go already
      }
    }
    ~Let() { Now(); }
  } let{release};
  (*plane)->SetHandlers(
      [&](uint16_t, std::string_view, std::string_view) {
        entered.set_value();
        // The slow call under test: it holds its loop until the test lets
        // it go, past the hello deadline of the connection below.
        released.wait();
        return SocketDataPlane::CallReply{0, "done"};
      },
      [](std::string_view, bool, uint64_t, uint64_t,
         uint64_t) -> absl::StatusOr<SocketDataPlane::Grant> {
        return absl::UnimplementedError("no transfers here");
      },
      [](std::string_view, std::string_view, std::string_view)
          -> absl::StatusOr<SocketDataPlane::Admission> { return SocketDataPlane::Admission{}; });
  const int port = std::stoi((*plane)->address().substr((*plane)->address().rfind(':') + 1));

  Raw busy;
  ASSERT_TRUE(Open(port, &busy).ok());
  ASSERT_TRUE(SendHello(busy).ok());
  ASSERT_EQ(ReplyCode(busy).value_or(-1), 0);
  // A second connection has its challenge: its hello is due within 200 ms.
  Raw late;
  ASSERT_TRUE(Open(port, &late).ok());
  // Its deadline was set before its challenge was sent: by this, past.
  const auto hello_due = std::chrono::steady_clock::now() + kHelloTimeout;
  // The first one's call holds the loop; the second's hello arrives then.
  const std::string body = "call";
  wire::Frame call;
  call.op = wire::kCall;
  call.method = 1;
  call.length = body.size();
  iovec v[2] = {{&call, sizeof(call)}, {const_cast<char*>(body.data()), body.size()}};
  ASSERT_TRUE(net::WriteAll(busy.fd, v, 2, net::Clock::now() + 5s).ok());
  entered.get_future().wait();
  ASSERT_TRUE(SendHello(late).ok());
  // The call ends only once the hello's deadline has passed.
  ASSERT_TRUE(testing::WaitFor([&] { return std::chrono::steady_clock::now() > hello_due; }));
  let.Now();

  EXPECT_EQ(ReplyCode(busy).value_or(-1), 0);
  // Sent in time, read late: the hello is answered, not timed out.
  auto said = ReplyCode(late);
  ASSERT_TRUE(said.ok()) << "the connection was closed: " << said.status();
  EXPECT_EQ(*said, 0);
  EXPECT_EQ((*plane)->stats().hello_timeouts, 0u);
}

TEST(SocketLoop, AConnectionThatSendsNoHelloIsStillClosedAtItsDeadline) {
  SocketDataPlane::Options o;
  o.threads = 1;
  o.hello_timeout = std::chrono::duration_cast<std::chrono::milliseconds>(kHelloTimeout);
  auto plane = SocketDataPlane::Start("127.0.0.1:0", o);
  ASSERT_TRUE(plane.ok()) << plane.status();
  const int port = std::stoi((*plane)->address().substr((*plane)->address().rfind(':') + 1));
  Raw silent;
  ASSERT_TRUE(Open(port, &silent).ok());
  // Nothing sent: the store ends the connection (a read sees its end).
  auto said = ReplyCode(silent);
  EXPECT_FALSE(said.ok());
  EXPECT_EQ((*plane)->stats().hello_timeouts, 1u);
}

}  // namespace
}  // namespace kvtier
