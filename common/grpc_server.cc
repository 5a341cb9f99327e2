#include "common/grpc_server.h"

#include <grpcpp/support/server_interceptor.h>

#include <string>

namespace kvtier {
namespace {

class MalformedRequestInterceptor final : public grpc::experimental::Interceptor {
 public:
  explicit MalformedRequestInterceptor(grpc::experimental::ServerRpcInfo* info)
      : method_(info->method() ? info->method() : "?") {}

  void Intercept(grpc::experimental::InterceptorBatchMethods* m) override {
    using grpc::experimental::InterceptionHookPoints;
    if (m->QueryInterceptionHookPoint(InterceptionHookPoints::PRE_SEND_STATUS)) {
      grpc::Status s = m->GetSendStatus();
      // Handlers never answer INTERNAL without a message; gRPC does so when
      // the request bytes do not deserialize.
      if (s.error_code() == grpc::StatusCode::INTERNAL && s.error_message().empty()) {
        m->ModifySendStatus(grpc::Status(
            grpc::StatusCode::INVALID_ARGUMENT,
            "request to " + method_ + " is not a valid protobuf message of the expected type "
            "(malformed or truncated)"));
      }
    }
    m->Proceed();
  }

 private:
  std::string method_;
};

class MalformedRequestFactory final
    : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  grpc::experimental::Interceptor* CreateServerInterceptor(
      grpc::experimental::ServerRpcInfo* info) override {
    return new MalformedRequestInterceptor(info);
  }
};

}  // namespace

std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>>
ServerInterceptors() {
  std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>> v;
  v.push_back(std::make_unique<MalformedRequestFactory>());
  return v;
}

}  // namespace kvtier
