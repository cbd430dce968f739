"""The OpenAI chat request (/v1/chat/completions): messages of text parts, tools and tool_choice, and vLLM's
chat template controls; /tokenize's request, which renders messages the same way. The sampling fields it
shares with completions are gateway.openai_api's."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from gateway.openai_api import SamplingFields, invalid
from shared.sampling_params import INT32_MAX, MAX_LOGPROBS


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _parts(cls, content: Any) -> Any:
        """Content parts: only text ones (this gateway serves text models), each {"type": "text", "text": str}."""
        if not isinstance(content, list):
            return content
        for i, part in enumerate(content):
            if not isinstance(part, dict):
                raise invalid(f"[{i}]", f"a content part must be an object like {{\"type\": \"text\", "
                                        f"\"text\": \"...\"}}, got {type(part).__name__}")
            if part.get("type") != "text":
                raise invalid(f"[{i}].type", f"unsupported content part type {part.get('type')!r}: this model "
                                             "reads only \"text\" parts")
            if not isinstance(part.get("text"), str):
                raise invalid(f"[{i}].text", f"a text part needs a string `text`, got "
                                             f"{type(part.get('text')).__name__}")
        return content

    def as_template_input(self) -> dict[str, Any]:
        content = self.content
        if isinstance(content, list):
            content = "".join(p.text for p in content)
        msg = {"role": "system" if self.role == "developer" else self.role, "content": content or ""}
        if self.name:
            msg["name"] = self.name
        for key in ("tool_calls", "tool_call_id"):  # an earlier turn's calls and their results, for the template
            if (self.model_extra or {}).get(key) is not None:
                msg[key] = self.model_extra[key]
        return msg


class FunctionSpec(BaseModel):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments (None: any object)
    strict: bool | None = None


class Tool(BaseModel):
    type: Literal["function"]
    function: FunctionSpec


ANY_OBJECT: dict[str, Any] = {"type": "object"}


def tool_call_schema(tools: list[Tool], name: str | None) -> dict[str, Any]:
    """The JSON schema the answer is held to: the named function's parameters, or (name None: tool_choice
    "required") an array of calls."""
    if name is not None:
        tool = next(t for t in tools if t.function.name == name)
        return tool.function.parameters or ANY_OBJECT
    calls = [{"type": "object", "properties": {"name": {"type": "string", "enum": [t.function.name]},
                                               "parameters": t.function.parameters or ANY_OBJECT},
              "required": ["name", "parameters"], "additionalProperties": False} for t in tools]
    return {"type": "array", "minItems": 1, "items": {"anyOf": calls}}


# what the gateway itself passes to apply_chat_template: not chat_template_kwargs' to set
TEMPLATE_ARGUMENTS = frozenset({"messages", "conversation", "tools", "documents", "add_generation_prompt",
                                "continue_final_message", "tokenize", "chat_template", "return_dict", "padding",
                                "truncation", "max_length", "return_tensors", "return_assistant_tokens_mask"})


class _ChatTemplateFields(BaseModel):
    """What renders a chat through the template besides its messages (a chat request, a /tokenize of messages):
    the tools, and vLLM's template controls."""

    tools: list[Tool] | None = Field(None, max_length=128)
    add_generation_prompt: bool = Field(True, description="open the assistant's turn after the messages")
    continue_final_message: bool = Field(False, description="the last message (usually an assistant's) is left "
                                                            "open, and the answer continues it; needs "
                                                            "add_generation_prompt false")
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description="more variables for the chat template (e.g. {\"enable_thinking\": false})")

    def template_tools(self) -> list[dict[str, Any]] | None:
        return [t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None

    def template_options(self) -> dict[str, Any]:
        """The template's arguments besides the messages and the tools."""
        return {**(self.chat_template_kwargs or {}), "add_generation_prompt": self.add_generation_prompt,
                "continue_final_message": self.continue_final_message}

    @model_validator(mode="after")
    def _template_options_agree(self) -> Any:
        if self.continue_final_message and self.add_generation_prompt:
            raise invalid("continue_final_message", "needs add_generation_prompt false: the answer either continues "
                                                    "the last message or opens a new turn")
        taken = sorted(set(self.chat_template_kwargs or {}) & TEMPLATE_ARGUMENTS)
        if taken:
            raise invalid(f"chat_template_kwargs.{taken[0]}", "is set by the request itself (messages, tools, "
                                                              "add_generation_prompt, continue_final_message)")
        return self


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(SamplingFields, _ChatTemplateFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    max_completion_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None, description="\"required\" or a named function: the answer is a call, its arguments held to the "
                          "function's parameters schema (structured outputs); \"auto\" (the default with tools): the "
                          "model decides, and its calls are read out of its own format (a gateway started with "
                          "--enable-auto-tool-choice --tool-call-parser NAME); \"none\": no call")
    parallel_tool_calls: bool | None = None

    def tool_mode(self) -> str | None:
        """"named" (tool_choice names a function), "required", "auto" (tools given, no other choice), or None (no
        call: tool_choice "none", or no tools)."""
        choice = self.tool_choice
        if isinstance(choice, NamedToolChoice):
            return "named"
        if choice == "required":
            return "required"
        return "auto" if self.tools and choice in (None, "auto") else None

    def named_tool(self) -> str | None:
        return self.tool_choice.function.name if isinstance(self.tool_choice, NamedToolChoice) else None

    def structured_spec(self) -> tuple[str, dict[str, Any]] | None:
        mode, names = self.tool_mode(), [t.function.name for t in self.tools or []]
        if mode not in ("named", "required") or not names or (mode == "named" and self.named_tool() not in names):
            return super().structured_spec()  # no call forced, or a wrong one (_tools_and_choice_agree says so)
        return "tools", {"json": tool_call_schema(self.tools or [], self.named_tool())}

    @model_validator(mode="after")
    def _tools_and_choice_agree(self) -> ChatCompletionRequest:
        choice, names = self.tool_choice, [t.function.name for t in self.tools or []]
        if self.tool_mode() in ("named", "required"):
            if not self.tools:
                raise invalid("tools", f"are required with tool_choice {self.named_tool() or 'required'!r}")
            if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
                raise invalid("tool_choice.function.name", f"{choice.function.name!r} is not one of the tools: "
                                                            f"{', '.join(names)}")
            if super().structured_spec() is not None:
                raise invalid("tool_choice", "a tool call cannot also take response_format or structured outputs")
        return self



class TokenizeRequest(_ChatTemplateFields):
    """vLLM's POST /tokenize: a prompt's token ids, or chat messages' through the chat template, as
    /v1/completions and /v1/chat/completions would run them."""

    model_config = ConfigDict(extra="ignore")

    model: str
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: bool | None = Field(None, description="default: true for a prompt, false for messages "
                                                              "(the chat template holds them)")
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise invalid("prompt", "give either prompt (text) or messages (a chat), not both or neither")
        return self

