// The models a frontend serves: which one a request names, /v1/models,
// and the vLLM endpoints passed through by load (frontend/openai.h).
#include <algorithm>
#include <iterator>

#include "absl/strings/str_cat.h"
#include "frontend/openai.h"

namespace kvtier::frontend {
namespace {

using nlohmann::json;

PrepareResult Fail(ApiError e) {
  PrepareResult r;
  r.error = std::move(e);
  return r;
}

ApiError Invalid(std::string message) {
  return ApiError{400, "invalid_request_error", std::move(message), "", ""};
}

}  // namespace

const ServedModel* FindModel(const std::vector<ServedModel>& models, std::string_view name) {
  if (models.empty()) return nullptr;
  if (name.empty()) return &models.front();
  for (const ServedModel& m : models) {
    if (m.name == name) return &m;
    if (std::find(m.adapters.begin(), m.adapters.end(), name) != m.adapters.end()) return &m;
  }
  return nullptr;
}

// The model a request's JSON names: `*m` is set, or the error (400 for a
// model that is not a string, 404 for one not served).
std::optional<ApiError> ModelOf(const json& req, const std::vector<ServedModel>& models,
                                const ServedModel** m) {
  std::string name;
  if (req.contains("model")) {
    if (!req["model"].is_string())
      return ApiError{400, "invalid_request_error", "model must be a string", "model", ""};
    name = req["model"].get_ref<const std::string&>();
  }
  *m = FindModel(models, name);
  if (*m == nullptr) {
    return ApiError{404, "NotFoundError", absl::StrCat("The model `", name, "` does not exist."),
                    "model", "model_not_found"};
  }
  return std::nullopt;
}

bool IsPassThrough(std::string_view path) {
  return std::find(std::begin(kPassThroughPaths), std::end(kPassThroughPaths), path) !=
         std::end(kPassThroughPaths);
}

PrepareResult PreparePassThrough(std::string_view path, std::string_view body,
                                 const std::vector<ServedModel>& models) {
  json req = json::parse(body, nullptr, /*allow_exceptions=*/false);
  if (req.is_discarded()) return Fail(Invalid("the body is not valid JSON"));
  if (!req.is_object()) return Fail(Invalid("the body must be a JSON object"));
  const ServedModel* model = nullptr;
  if (auto e = ModelOf(req, models, &model)) return Fail(*e);
  PrepareResult r;
  Prepared& p = r.prepared;
  p.endpoint = Endpoint::kPassThrough;
  p.path = std::string(path);
  p.namespace_id = model->namespace_id;
  if (req.contains("stream") && req["stream"].is_boolean()) p.stream = req["stream"].get<bool>();
  if (!req.contains("model") || req["model"].get_ref<const std::string&>().empty()) {
    req["model"] = model->name;
    p.body = req.dump(-1, ' ', false, json::error_handler_t::replace);
  } else {
    p.body = std::string(body);
  }
  return r;
}

std::string ModelsBody(const std::string& served_model, uint64_t created_unix,
                       uint64_t max_model_len, const std::vector<std::string>& adapters) {
  json models = json::array();
  models.push_back({{"id", served_model},
                    {"object", "model"},
                    {"created", created_unix},
                    {"owned_by", "kvtier"},
                    {"root", served_model},
                    {"parent", nullptr},
                    {"max_model_len", max_model_len}});
  for (const auto& a : adapters) {
    models.push_back({{"id", a},
                      {"object", "model"},
                      {"created", created_unix},
                      {"owned_by", "kvtier"},
                      {"root", a},
                      {"parent", served_model},
                      {"max_model_len", max_model_len}});
  }
  return json{{"object", "list"}, {"data", models}}.dump();
}

std::string ModelsBody(const std::vector<ServedModel>& models, uint64_t created_unix) {
  json all = json::array();
  for (const ServedModel& m : models) {
    json one = json::parse(ModelsBody(m.name, created_unix, m.max_model_len, m.adapters));
    for (auto& entry : one["data"]) all.push_back(std::move(entry));
  }
  return json{{"object", "list"}, {"data", all}}.dump();
}

}  // namespace kvtier::frontend
