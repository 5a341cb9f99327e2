// render: renders a Helm chart's templates with Go's text/template and the
// sprig function library -- the engine Helm itself uses -- for tests on a
// machine without the helm binary. Usage: render CHART_DIR CONTEXT_JSON
// where CONTEXT_JSON holds {"Values": ..., "Release": {...}, "Chart": {...}}.
// Prints every rendered file as "# Source: NAME" followed by its text.
package main

import (
	"bytes"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"text/template"

	"github.com/Masterminds/sprig"
)

type chartFiles struct{ dir string }

// Get returns the chart file's text ("" if it cannot be read, as Helm).
func (f chartFiles) Get(name string) string {
	b, err := os.ReadFile(filepath.Join(f.dir, name))
	if err != nil {
		return ""
	}
	return string(b)
}

func main() {
	if len(os.Args) != 3 {
		fmt.Fprintln(os.Stderr, "usage: render CHART_DIR CONTEXT_JSON")
		os.Exit(2)
	}
	raw, err := os.ReadFile(os.Args[2])
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	var ctx map[string]interface{}
	if err := json.Unmarshal(raw, &ctx); err != nil {
		fmt.Fprintln(os.Stderr, "context:", err)
		os.Exit(1)
	}
	// .Files.Get, as Helm: a file of the chart by its path.
	ctx["Files"] = chartFiles{os.Args[1]}
	files, _ := filepath.Glob(filepath.Join(os.Args[1], "templates", "*"))
	sort.Strings(files)
	root := template.New("chart")
	funcs := sprig.TxtFuncMap()
	// Helm's own additions that the chart uses.
	funcs["include"] = func(name string, data interface{}) (string, error) {
		var b bytes.Buffer
		err := root.ExecuteTemplate(&b, name, data)
		return b.String(), err
	}
	funcs["required"] = func(msg string, v interface{}) (interface{}, error) {
		if v == nil || v == "" {
			return nil, fmt.Errorf("%s", msg)
		}
		return v, nil
	}
	// lookup: what the context's "Cluster" holds under "Kind/namespace/name"
	// (objects already in the cluster), else an empty map, as helm template.
	funcs["lookup"] = func(apiVersion, kind, namespace, name string) (map[string]interface{}, error) {
		if cluster, ok := ctx["Cluster"].(map[string]interface{}); ok {
			if obj, ok := cluster[kind+"/"+namespace+"/"+name].(map[string]interface{}); ok {
				return obj, nil
			}
		}
		return map[string]interface{}{}, nil
	}
	root.Funcs(funcs).Option("missingkey=error")
	for _, f := range files {
		text, err := os.ReadFile(f)
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(1)
		}
		if _, err := root.New(filepath.Base(f)).Parse(string(text)); err != nil {
			fmt.Fprintln(os.Stderr, "parse:", err)
			os.Exit(1)
		}
	}
	for _, f := range files {
		name := filepath.Base(f)
		if strings.HasPrefix(name, "_") {
			continue
		}
		var b bytes.Buffer
		if err := root.ExecuteTemplate(&b, name, ctx); err != nil {
			fmt.Fprintln(os.Stderr, "render:", err)
			os.Exit(1)
		}
		fmt.Printf("# Source: %s\n%s\n", name, b.String())
	}
}
